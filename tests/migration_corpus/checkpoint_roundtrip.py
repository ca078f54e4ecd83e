# pattern: checkpoint saved from cuda:0 by the script itself (model, optimizer, AMP scaler, CUDA RNG state), reloaded with torch.load with and without map_location ("cuda:0", {"cuda:1": "cuda:0"}, a lambda, torch.device)
# launch: hal run
# twin: --device cpu
# compare: exact
# expect: ok
# may-warn: torch.cuda.get_rng_state
"""Save a training checkpoint on the GPU, reload it every way real code does, and resume.

Run with --device cpu the script is its own host twin (map_location "cpu" everywhere). The saved
CUDA RNG state is the host generator's on the host: it round-trips exactly, so no warning is
needed there (one is tolerated).
"""
import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda:0")
args = parser.parse_args()
on_gpu = args.device.startswith("cuda")


def make_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g).to(args.device)
        y = torch.randint(0, 2, (32,), generator=g).to(args.device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


torch.manual_seed(0)
model = make_model().to(args.device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = train(model, optimizer, 2, seed=1)

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "checkpoint.pt")
    torch.save({
        "epoch": 1,
        "model_state_dict": model.state_dict(),
        "optimizer_state_dict": optimizer.state_dict(),
        "rng_state": torch.cuda.get_rng_state() if on_gpu else torch.get_rng_state(),
    }, path)
    weights_path = os.path.join(tmp, "weights.pth")
    torch.save(model.state_dict(), weights_path)

    plain = torch.load(path)  # no map_location: storages go back where they were saved
    assert plain["model_state_dict"]["0.weight"].device == torch.device(args.device)
    if on_gpu:
        loaded = [
            torch.load(path, map_location="cuda:0"),
            torch.load(path, map_location={"cuda:1": "cuda:0"}),
            torch.load(path, map_location=lambda storage, loc: storage.cuda(0)),
            torch.load(path, map_location=torch.device("cuda", 0)),
        ]
        state_only = torch.load(weights_path, map_location="cuda")
    else:
        loaded = [torch.load(path, map_location="cpu") for _ in range(4)]
        state_only = torch.load(weights_path, map_location="cpu")
    for ckpt in loaded:
        for key, value in ckpt["model_state_dict"].items():
            assert torch.equal(value, plain["model_state_dict"][key]), key
            assert value.device == plain["model_state_dict"][key].device

# Resume into fresh objects from the no-map_location load.
resumed = make_model().to(args.device)
resumed.load_state_dict(plain["model_state_dict"])
resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
resumed_opt.load_state_dict(plain["optimizer_state_dict"])
assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), state_only.values()))
losses += train(resumed, resumed_opt, 2, seed=2)

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in resumed.parameters()),
    "epoch": plain["epoch"],
}), flush=True)
