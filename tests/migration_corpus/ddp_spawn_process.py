# pattern: DDP over nccl with ranks started as multiprocessing.get_context("spawn").Process, file:// rendezvous, results through a Queue
# launch: hal run
# procs: 3
# twin: --cpu
# compare: exact
# expect: ok
"""Two DDP ranks started by hand with the stdlib's spawn context (CUDA cannot be forked).

    python ddp_spawn_process.py          # one GPU per rank
    python ddp_spawn_process.py --cpu    # gloo on the host
"""
import argparse
import json
import multiprocessing
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def worker(rank, world_size, init_file, use_cpu, steps, results):
    if use_cpu:
        device = torch.device("cpu")
        backend = "gloo"
    else:
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3)).to(device)
    model = DistributedDataParallel(model, device_ids=None if use_cpu else [rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(7 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 12, generator=g).to(device)
        y = torch.randint(0, 3, (16,), generator=g).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    checksum = sum(p.detach().cpu().double().sum().item() for p in model.module.parameters())
    results.put((rank, losses, checksum))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_size = 2

    ctx = multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=worker, args=(r, world_size, init_file, args.cpu, args.steps, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    by_rank = dict((r, (losses, checksum)) for r, losses, checksum in (results.get() for _ in range(world_size)))
    print("RESULT " + json.dumps({
        "losses": [by_rank[r][0] for r in range(world_size)],
        "checksum": by_rank[0][1],
        "ranks_agree": by_rank[0][1] == by_rank[1][1],
    }), flush=True)


if __name__ == "__main__":
    main()
