# pattern: torch.is_autocast_enabled("cuda") / torch.is_autocast_enabled() / torch.get_autocast_dtype("cuda") queried inside autocast (flash-attn style dtype fix-up)
# launch: hal run
# twin: --device cpu
# compare: rtol=1e-3
# expect: ok
"""An attention block that, like many fused-kernel wrappers, asks autocast which dtype it runs in.

Kernels that bypass autocast (flash-attn, xformers, apex) cast q/k/v themselves:
``if torch.is_autocast_enabled(): q = q.to(torch.get_autocast_dtype("cuda"))``. If the query
says "not enabled" the block silently runs in fp32 and the asserts below fire.
"""
import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, device_type):
        super().__init__()
        self.heads = heads
        self.device_type = device_type
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        if torch.is_autocast_enabled(self.device_type):
            dtype = torch.get_autocast_dtype(self.device_type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.float(), dim=-1).to(q.dtype)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device_type = "cuda" if "cuda" in args.device else "cpu"

    torch.manual_seed(0)
    model = SelfAttention(32, 4, device_type).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8, 32, device=args.device)
    target = torch.randn(2, 8, 32, device=args.device)

    assert not torch.is_autocast_enabled(device_type)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=torch.bfloat16):
            enabled = torch.is_autocast_enabled(device_type)
            if device_type == "cuda":
                legacy = torch.is_autocast_enabled()  # the argument-less form asks about CUDA
            else:
                legacy = enabled
            assert enabled and legacy, (enabled, legacy)
            assert torch.get_autocast_dtype(device_type) == torch.bfloat16
            out = model(x)
            loss = F.mse_loss(out.float(), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert not torch.is_autocast_enabled(device_type)

    print("RESULT " + json.dumps({
        "losses": losses,
        "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
        "out_dtype": str(out.dtype),
    }), flush=True)


if __name__ == "__main__":
    main()
