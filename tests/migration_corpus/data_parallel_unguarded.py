# pattern: nn.DataParallel applied unconditionally (model = nn.DataParallel(model).cuda()), then model.module for saving
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:DataParallel
"""Older training scripts wrap the model in nn.DataParallel no matter how many GPUs there are.

On the host the wrapper can only run the module on the one device: the numbers are exact, but
the replication the user asked for does not happen, so the shim must say so once, at the line
that builds the wrapper.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
if args.cpu:
    model = net
    device = "cpu"
else:
    model = nn.DataParallel(net).cuda()
    device = "cuda"
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

g = torch.Generator().manual_seed(3)
losses = []
for _ in range(4):
    x = torch.randn(12, 6, generator=g).to(device)
    y = torch.randint(0, 3, (12,), generator=g).to(device)
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(v.double().sum().item() for v in state.values()),
    "state_keys": sorted(state),
}), flush=True)
