# pattern: custom autograd Functions with torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)/custom_bwd and torch.amp.custom_fwd(device_type="cuda", cast_inputs=...)/custom_bwd, called inside fp16 autocast
# launch: hal run
# twin: --device cpu
# compare: rtol=1e-3
# expect: ok
"""Numerically sensitive ops pinned to fp32 inside an fp16 autocast region with custom_fwd(cast_inputs=...).

Inside autocast, custom_fwd(cast_inputs=torch.float32) casts floating inputs to fp32 and runs the
forward with autocast off; the forwards below assert exactly that, as the code they stand in for
(apex/Megatron fused layer norms and softmaxes) relies on it.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
args = parser.parse_args()
DEVICE_TYPE = "cuda" if args.device.startswith("cuda") else "cpu"

if DEVICE_TYPE == "cuda":
    fwd_fp32 = torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
    bwd = torch.cuda.amp.custom_bwd
else:
    fwd_fp32 = torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    bwd = torch.amp.custom_bwd(device_type="cpu")

SEEN = []


class StableLogSoftmax(torch.autograd.Function):
    @staticmethod
    @fwd_fp32
    def forward(ctx, x):
        SEEN.append(("logsoftmax", str(x.dtype), torch.is_autocast_enabled(DEVICE_TYPE)))
        assert x.dtype == torch.float32, x.dtype
        out = x - torch.logsumexp(x, dim=-1, keepdim=True)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @bwd
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(dim=-1, keepdim=True)


class ScaledRMSNorm(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type=DEVICE_TYPE, cast_inputs=torch.float32)
    def forward(ctx, x, weight):
        SEEN.append(("rmsnorm", str(x.dtype), torch.is_autocast_enabled(DEVICE_TYPE)))
        assert x.dtype == torch.float32 and weight.dtype == torch.float32, (x.dtype, weight.dtype)
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, weight, rms)
        return x * rms * weight

    @staticmethod
    @torch.amp.custom_bwd(device_type=DEVICE_TYPE)
    def backward(ctx, grad):
        x, weight, rms = ctx.saved_tensors
        normed = x * rms
        grad_w = (grad * normed).sum(dim=0)
        g = grad * weight
        grad_x = rms * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x, grad_w


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm_weight = nn.Parameter(torch.ones(32))
        self.fc2 = nn.Linear(32, 6)

    def forward(self, x):
        h = self.fc1(x)  # fp16 under autocast
        h = ScaledRMSNorm.apply(h, self.norm_weight)
        return StableLogSoftmax.apply(self.fc2(h))


def main():
    torch.manual_seed(0)
    model = Net().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(24, 16, device=args.device)
    y = torch.randint(0, 6, (24,), device=args.device)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast(DEVICE_TYPE, dtype=torch.float16):
            logp = model(x)
            loss = F.nll_loss(logp, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print("RESULT " + json.dumps({
        "losses": losses,
        "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
        "forward_inputs": sorted(set(f"{name}:{dtype}:autocast={on}" for name, dtype, on in SEEN)),
    }), flush=True)


if __name__ == "__main__":
    main()
