# pattern: DataLoader(pin_memory=True, num_workers=1) with .cuda(non_blocking=True) / .to(device, non_blocking=True) in the loop
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""The standard GPU input pipeline: pinned host batches from a worker, asynchronous copies.

Pinning only stages host memory for a device copy; on the host target there is no copy to
stage, so the run must be exact and quiet - in particular no "pin_memory ... no accelerator"
warning from torch's DataLoader, which a GPU user never sees.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
use_cuda = not args.cpu

torch.manual_seed(0)
g = torch.Generator().manual_seed(21)
dataset = TensorDataset(torch.randn(48, 3, 8, 8, generator=g), torch.randint(0, 3, (48,), generator=g))
loader_kwargs = {"batch_size": 12, "shuffle": True, "generator": torch.Generator().manual_seed(5)}
if use_cuda:
    loader_kwargs.update({"num_workers": 1, "pin_memory": True})
loader = DataLoader(dataset, **loader_kwargs)
device = torch.device("cuda" if use_cuda else "cpu")

model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
losses, pinned = [], []
for images, labels in loader:
    if use_cuda:
        pinned.append(images.is_pinned())
        images = images.cuda(non_blocking=True)
        labels = labels.to(device, non_blocking=True)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "info": {"batches_pinned": pinned},
}), flush=True)
