# pattern: memory statistics: torch.cuda.memory_allocated / max_memory_allocated / memory_reserved / reset_peak_memory_stats / mem_get_info logged per step
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:torch.cuda.memory_allocated
# expect: warn:torch.cuda.max_memory_allocated
# expect: warn:torch.cuda.memory_reserved
# may-warn: torch.cuda.reset_peak_memory_stats
# may-warn: torch.cuda.mem_get_info
"""Per-step memory logging as training loops and benchmark scripts print it.

On the host these numbers are the process's resident set, not bytes held by tensors in a caching
allocator: memory_allocated, max_memory_allocated and memory_reserved are approximations and
must each be warned about once, at the script's line. mem_get_info (free/total memory of the
device = the host's RAM) and reset_peak_memory_stats (resets the peak the max_* calls read)
mean what they say on the host; a warning there is tolerated, not required. The numbers must
still be sane: positive, peak >= current after the step, free <= total.
"""
import argparse
import json

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
MB = 1024 ** 2

torch.manual_seed(0)
device = "cpu" if args.cpu else "cuda"
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

if not args.cpu:
    free, total = torch.cuda.mem_get_info()
    print(f"device memory: {free / MB:.0f} MiB free of {total / MB:.0f} MiB", flush=True)
    sane = [0 < free <= total]
else:
    sane = []

losses = []
for step in range(3):
    if not args.cpu:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    x = torch.randn(64, 256, device=device)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if not args.cpu:
        allocated = torch.cuda.memory_allocated()
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.memory_reserved()
        print(f"step {step}: allocated {allocated / MB:.1f} MiB (was {before / MB:.1f}), "
              f"peak {peak / MB:.1f} MiB, reserved {reserved / MB:.1f} MiB", flush=True)
        sane.append(0 < allocated <= peak and reserved > 0)

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "memory_numbers_sane": all(sane),
}), flush=True)
