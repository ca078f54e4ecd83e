# pattern: resume from a checkpoint written on a real GPU (storages tagged cuda:0 and cuda:1): torch.load without map_location, with map_location={"cuda:1": "cuda:0"} and with map_location="cuda"
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""Fine-tune from a checkpoint someone saved on a 2-GPU box (data/gpu_checkpoint.pt, made by
data/make_gpu_checkpoint.py): weights and Adam state on cuda:0, EMA on cuda:1 - a file a
CPU-only torch refuses to load without map_location.

    python resume_gpu_checkpoint.py          # on the GPU
    python resume_gpu_checkpoint.py --cpu    # on the host: map_location="cpu"
"""
import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
CKPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpu_checkpoint.pt")

if args.cpu:
    device = torch.device("cpu")
    checkpoint = torch.load(CKPT, map_location="cpu")
    ema_on_0 = torch.load(CKPT, map_location="cpu")["ema"]
    model_only = torch.load(CKPT, map_location="cpu")["model"]
else:
    device = torch.device("cuda:0")
    checkpoint = torch.load(CKPT)  # storages return to cuda:0 / cuda:1
    ema_on_0 = torch.load(CKPT, map_location={"cuda:1": "cuda:0"})["ema"]
    model_only = torch.load(CKPT, map_location="cuda")["model"]
    assert checkpoint["model"]["0.weight"].device == torch.device("cuda:0")
    assert ema_on_0["0.weight"].device == torch.device("cuda:0")

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
model.load_state_dict(checkpoint["model"])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
optimizer.load_state_dict(checkpoint["optimizer"])
for key in model_only:
    assert torch.equal(model_only[key], checkpoint["model"][key].to(device)), key
    assert torch.equal(ema_on_0[key].to(device), model_only[key]), key

g = torch.Generator().manual_seed(2)
losses = []
for _ in range(3):
    x = torch.randn(32, 8, generator=g).to(device)
    y = torch.randint(0, 2, (32,), generator=g).to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "start_step": checkpoint["step"],
    "info": {"saved_with": checkpoint["torch_version"], "saved_on": checkpoint["device_name"]},
}), flush=True)
