# pattern: NVTX annotations for Nsight: torch.cuda.nvtx.range_push/range_pop around phases and the torch.cuda.nvtx.range context manager
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
# may-warn: nvtx
"""A training loop annotated for Nsight Systems (forward/backward/optimizer ranges per step).

Annotations change no number; on the host they have no Nsight to go to (torch.profiler's
record_function is the equivalent), so the run must complete with the twin's exact numbers.
A one-time note that the ranges go elsewhere is tolerated, not required.
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


class nvtx_range:  # noqa: N801 - the twin's no-op stand-in
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        if not args.cpu:
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc):
        if not args.cpu:
            torch.cuda.nvtx.range_pop()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 12, device=device)
y = torch.randint(0, 2, (16,), device=device)
losses = []
for step in range(3):
    if not args.cpu:
        torch.cuda.nvtx.range_push(f"step {step}")
    with nvtx_range("forward"):
        loss = F.cross_entropy(model(x), y)
    if args.cpu:
        loss.backward()
    else:
        with torch.cuda.nvtx.range("backward"):
            loss.backward()
    with nvtx_range("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    if not args.cpu:
        torch.cuda.nvtx.range_pop()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
}), flush=True)
