# pattern: torch.cuda.make_graphed_callables(module, sample_args) for partial-network capture, then ordinary training
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:make_graphed_callables
"""Partial-network CUDA graphs: make_graphed_callables returns a module whose forward and
backward replay captured graphs, and the training loop stays ordinary Python.

Unlike whole-step capture, this has an exact host fallback: the callable run eagerly computes
the same thing. The run must complete with the twin's exact numbers, warned once at the
make_graphed_callables line that nothing is captured on the host.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
device = "cpu" if args.cpu else "cuda"

torch.manual_seed(0)
module1 = nn.Linear(10, 20).to(device)
module2 = nn.Sequential(nn.ReLU(), nn.Linear(20, 3)).to(device)
optimizer = torch.optim.SGD(list(module1.parameters()) + list(module2.parameters()), lr=0.1)

if not args.cpu:
    sample1 = torch.randn(8, 10, device=device)
    sample2 = torch.randn(8, 20, device=device, requires_grad=True)
    module1 = torch.cuda.make_graphed_callables(module1, (sample1,))
    module2 = torch.cuda.make_graphed_callables(module2, (sample2,))

g = torch.Generator().manual_seed(9)
losses = []
for _ in range(4):
    x = torch.randn(8, 10, generator=g).to(device)
    y = torch.randint(0, 3, (8,), generator=g).to(device)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(module2(module1(x)), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

params = list(module1.parameters()) + list(module2.parameters())
print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in params),
}), flush=True)
