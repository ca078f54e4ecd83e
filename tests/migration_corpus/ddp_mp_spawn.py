# pattern: DDP over nccl started with torch.multiprocessing.spawn (MASTER_ADDR/PORT set by the script, model.to(rank))
# launch: hal run
# procs: 3
# twin: --cpu
# compare: exact
# expect: ok
"""The "Getting Started with Distributed Data Parallel" tutorial's basic demo, two ranks.

    python ddp_mp_spawn.py          # one GPU per rank
    python ddp_mp_spawn.py --cpu    # gloo on the host
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size, port, backend):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size, port, use_cpu, steps):
    setup(rank, world_size, port, "gloo" if use_cpu else "nccl")
    torch.manual_seed(0)
    if use_cpu:
        model = ToyModel()
        ddp_model = DDP(model)
        device = "cpu"
    else:
        torch.cuda.set_device(rank)
        model = ToyModel().to(rank)
        ddp_model = DDP(model, device_ids=[rank])
        device = rank

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    torch.manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10).to(device))
        labels = torch.randn(20, 5).to(device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    all_losses = [None] * world_size
    dist.all_gather_object(all_losses, losses)
    checksum = sum(p.detach().cpu().double().sum().item() for p in model.parameters())
    if rank == 0:
        print("RESULT " + json.dumps({"losses": all_losses, "checksum": checksum}), flush=True)
    cleanup()


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_size = 2
    if not args.cpu:
        n_gpus = torch.cuda.device_count()
        print(f"Running basic DDP example on {world_size} ranks ({n_gpus} GPU(s) visible).")
    mp.spawn(demo_basic, args=(world_size, free_port(), args.cpu, args.steps), nprocs=world_size, join=True)
