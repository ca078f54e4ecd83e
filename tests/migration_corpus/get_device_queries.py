# pattern: device ordinals from tensors and the runtime: tensor.get_device(), torch.cuda.current_device(), torch.cuda.device(ordinal) context, torch.device("cuda", x.get_device())
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""Library-style code that follows its input's device ordinal (apex, detectron-era ops):
buffers are made on ``x.get_device()``, work runs under ``with torch.cuda.device(...)``.

On CUDA ``get_device()`` is the ordinal (0 here); -1 means "CPU tensor" and makes these paths
fail (``torch.device("cuda", -1)`` is an error). The migrated tensors stand for cuda:0, so the
answers must be those of cuda:0 and the run must match the host twin exactly.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()


def make_noise_like(x, std):
    if args.cpu:
        return torch.randn(x.shape, device=x.device) * std
    ordinal = x.get_device()
    assert ordinal >= 0, f"expected a CUDA tensor, got get_device() = {ordinal}"
    with torch.cuda.device(ordinal):
        return torch.randn(x.shape, device=torch.device("cuda", ordinal)) * std


torch.manual_seed(0)
if args.cpu:
    device = torch.device("cpu")
else:
    device = torch.device("cuda", torch.cuda.current_device())
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 8).to(device)
y = x.sum(dim=1, keepdim=True)

ordinals = []
losses = []
for _ in range(3):
    noisy = x + make_noise_like(x, 0.1)
    ordinals.append(noisy.get_device() if not args.cpu else 0)
    loss = F.mse_loss(model(noisy), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

weight_ordinal = model[0].weight.get_device() if not args.cpu else 0
print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "ordinals": ordinals + [weight_ordinal],
}), flush=True)
