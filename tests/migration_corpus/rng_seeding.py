# pattern: CUDA RNG control: torch.cuda.manual_seed / manual_seed_all, torch.cuda.get_rng_state / set_rng_state to replay dropout masks (activation-recompute style)
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:sets the host generator
"""Seeding and RNG-state replay as reproducibility helpers and activation checkpointing do it.

On the host "the CUDA generator" is the host's default generator, so torch.cuda.manual_seed also
reseeds the host RNG that CPU-side sampling (shuffles, host randn) uses: on a GPU it would not.
The numbers match the host twin (which seeds the host generator where the CUDA script seeds the
CUDA one), but the coupling is an approximation the shim must warn about once, at the first
call that actually changes the host generator (reseeding with the seed torch.manual_seed just set
changes nothing and is not warned; here that is the set_rng_state replay). The dropout replay
must be exact (the script asserts it).
"""
import argparse
import json
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()
device = "cpu" if args.cpu else "cuda"


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not args.cpu:
        torch.cuda.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)


def get_state():
    return torch.get_rng_state() if args.cpu else torch.cuda.get_rng_state()


def set_state(state):
    if args.cpu:
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


set_seed(args.seed)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(20, 16, device=device)  # drawn from the device generator
y = torch.randint(0, 4, (20,), device=device)

losses, replays_match = [], []
for step in range(3):
    state = get_state()
    out_first = model(x)
    set_state(state)  # recompute with the same dropout mask
    out_again = model(x)
    replays_match.append(torch.equal(out_first, out_again))
    loss = F.cross_entropy(out_again, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

set_seed(args.seed)
fresh = torch.rand(3, device=device).tolist()
print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "replays_match": replays_match,
    "reseeded_draw": fresh,
}), flush=True)
