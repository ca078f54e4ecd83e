# pattern: backend flags at the top of a conv training script: torch.backends.cudnn.benchmark = True, torch.backends.cudnn.allow_tf32 = True, torch.backends.cuda.matmul.allow_tf32 = True
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:torch.backends.cuda.matmul.allow_tf32
# expect: warn:torch.backends.cudnn.allow_tf32
"""The Ampere speed-up flags most training scripts set before building the model.

The host has no TF32 mode: fp32 stays full precision (so the numbers equal the twin's, which sets
no flag), and each TF32 request must be warned about once at its line. cudnn.benchmark is a pure
speed hint with no numeric meaning: no warning is expected for it.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()

if not args.cpu:
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
device = "cpu" if args.cpu else "cuda"

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
images = torch.randn(16, 3, 12, 12, device=device)
labels = torch.randint(0, 4, (16,), device=device)
losses = []
for _ in range(3):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "matmul_tf32_reads_back": torch.backends.cuda.matmul.allow_tf32 if not args.cpu else False,
}), flush=True)
