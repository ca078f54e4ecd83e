"""``cuda_train.py`` written for the host by hand: no CUDA anywhere, gloo for the all-reduce.

Same seed, data, model, optimizer and printed lines, so the migrated CUDA script can be checked
against it: with AMP off the per-step losses must match exactly.
"""
import argparse
import json
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--amp", action="store_true", help="fp16 autocast with a dynamic loss scaler")
    return parser.parse_args()


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 128, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_data(seed: int, n: int = 1024, d_in: int = 32, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic classification data, drawn on the host so every device trains on the same set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = (x @ torch.randn(d_in, classes, generator=g)).argmax(dim=1)
    return x, y


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(args: argparse.Namespace) -> None:
    device = torch.device("cpu")
    model = MLP().to(device)
    x_all, y_all = make_data(args.seed)
    x_all, y_all = x_all.to(device), y_all.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(args.seed + 1)
    start = time.perf_counter()
    loss_value = float("nan")
    for step in range(args.steps):
        idx = torch.randint(0, x_all.shape[0], (args.batch,), generator=order).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
            loss = loss_fn(model(x_all[idx]), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        reported = loss.detach().float().clone()
        dist.all_reduce(reported)  # the mean over ranks (sum / world size)
        loss_value = reported.item() / dist.get_world_size()
        print(json.dumps({"step": step, "loss": loss_value}), flush=True)
    summary = {
        "summary": True,
        "steps": args.steps,
        "final_loss": loss_value,
        "amp": args.amp,
        "device": str(x_all.device.type),
        "peak_memory_bytes": peak_rss_bytes(),
        "seconds": round(time.perf_counter() - start, 3),
    }
    print(json.dumps(summary), flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            train(args)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
