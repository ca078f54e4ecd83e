# pattern: DDP over nccl started by torchrun's environment (env:// rendezvous, LOCAL_RANK, set_device, DistributedSampler, ReduceOp.AVG)
# launch: hal launch --nproc 2
# twin: --cpu
# compare: exact
# expect: ok
"""Data-parallel training the way the torchrun docs and the DDP tutorial write it.

    torchrun --standalone --nproc-per-node 2 ddp_torchrun.py
    torchrun --standalone --nproc-per-node 2 ddp_torchrun.py --cpu    # gloo on the host
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="train on the host with gloo")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.cpu:
        dist.init_process_group(backend="gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
        device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = ToyModel().to(device)
    ddp_model = DDP(model) if args.cpu else DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    sampler.set_epoch(0)

    losses = []
    for step, (inputs, targets) in enumerate(loader):
        if step == args.steps:
            break
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp_model(inputs), targets)
        loss.backward()
        optimizer.step()
        reported = loss.detach().clone()
        if args.cpu:  # gloo has no AVG
            dist.all_reduce(reported, op=dist.ReduceOp.SUM)
            reported /= world_size
        else:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())

    checksum = torch.tensor([sum(p.detach().cpu().double().sum().item() for p in model.parameters())], device=device)
    sums = [torch.zeros_like(checksum) for _ in range(world_size)]
    dist.all_gather(sums, checksum)
    if rank == 0:
        print("RESULT " + json.dumps({
            "losses": losses,
            "checksum": checksum.item(),
            "ranks_agree": all(torch.equal(s, sums[0]) for s in sums),
            "info": {"world_size": world_size, "device": str(inputs.device)},
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
