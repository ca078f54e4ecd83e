# pattern: tutorial-style benchmark loop: warm-up, torch.cuda.synchronize() around time.perf_counter(), cudnn.benchmark = True, samples/s report
# launch: hal run
# twin: --device cpu
# compare: exact
# expect: ok
"""How tutorials time a training step: warm up, synchronize, time N iterations, synchronize.

torch.cuda.synchronize has an exact host meaning (wait for queued work: there is none), so the
run must be quiet and exact.
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--warmup", type=int, default=2)
parser.add_argument("--iters", type=int, default=3)
args = parser.parse_args()
on_gpu = args.device == "cuda"

if on_gpu:
    torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
model = model.to(args.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batch = torch.randn(8, 3, 16, 16).to(args.device)
target = torch.randint(0, 10, (8,)).to(args.device)


def step():
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(batch), target)
    loss.backward()
    optimizer.step()
    return loss


for _ in range(args.warmup):
    step()
if on_gpu:
    torch.cuda.synchronize()
start = time.perf_counter()
losses = [step().item() for _ in range(args.iters)]
if on_gpu:
    torch.cuda.synchronize()
elapsed = time.perf_counter() - start
print(f"{args.iters * batch.shape[0] / elapsed:.1f} samples/s", flush=True)
print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "info": {"seconds": elapsed},
}), flush=True)
