# pattern: naive model parallel: requires torch.cuda.device_count() >= 2, first half of the model on cuda:0, second half on cuda:1, activations moved with .to("cuda:1")
# launch: hal run
# hal-args: --device-count 2
# twin: --cpu
# compare: exact
# expect: warn:cuda:0, cuda:1 all map to the one cpu device
"""The "Single-Machine Model Parallel" tutorial: a two-stage model split over two GPUs.

The host can stand in for both GPUs (every cuda:N maps to it) and the result is then exactly a
one-device run. The cpu target honestly has one device, so the script's own guard refuses to run
by default; `hal run --device-count 2` tells it two CUDA devices exist, and the expected outcome
is then a completed run equal to the twin, with one warning at the first placement that uses the
second ordinal, saying both CUDA devices share the one host device.
"""
import argparse
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

if not args.cpu and torch.cuda.device_count() < 2:
    sys.exit(f"this example needs 2 GPUs, found {torch.cuda.device_count()}")
dev0, dev1 = ("cpu", "cpu") if args.cpu else ("cuda:0", "cuda:1")


class ToyModelParallel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 20).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(20, 5).to(dev1)

    def forward(self, x):
        x = self.relu(self.net1(x.to(dev0)))
        return self.net2(x.to(dev1))


torch.manual_seed(0)
model = ToyModelParallel()
loss_fn = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(4):
    optimizer.zero_grad()
    outputs = model(torch.randn(20, 10, generator=g))
    labels = torch.randn(20, 5, generator=g).to(dev1)
    loss = loss_fn(outputs, labels)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
}), flush=True)
