# pattern: device-mesh tensor parallel: init_device_mesh("cuda", (2,)) + parallelize_module with ColwiseParallel/RowwiseParallel, under torchrun (hal launch --nproc 2)
# launch: hal launch --nproc 2
# twin: --device-type cpu
# compare: exact
# expect: ok
"""A Megatron-style MLP split over two ranks with the DTensor tensor-parallel API (the TP tutorial).

    torchrun --standalone --nproc-per-node 2 tensor_parallel_mesh.py
    torchrun --standalone --nproc-per-node 2 tensor_parallel_mesh.py --device-type cpu   # gloo on the host
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-type", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if args.device_type == "cuda":
        torch.cuda.set_device(local_rank)
    tp_mesh = init_device_mesh(args.device_type, (world_size,), mesh_dim_names=("tp",))

    torch.manual_seed(0)  # every rank builds the same full model before it is sharded
    model = FeedForward(16, 32).to(args.device_type)
    model = parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(8, 16, generator=g).to(args.device_type)  # same input on every TP rank
        target = torch.randn(8, 16, generator=g).to(args.device_type)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    full = {name: p.full_tensor().double().sum().item() for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "losses": losses,
            "checksum": sum(full.values()),
            "local_w1_rows": model.w1.weight.to_local().shape[0],
            "info": {"mesh": str(tp_mesh)},
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
