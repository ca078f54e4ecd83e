# pattern: torch.cuda.is_bf16_supported(including_emulation=False) picks bf16 or fp16 (+ GradScaler only for fp16)
# launch: hal run
# twin: none
# expect: ok
"""Choose the autocast dtype from what the GPU does natively (Ampere+: bf16, else fp16 with a scaler).

The answer on the host depends on the CPU, so there is no twin: the run must complete, report the
dtype it chose, and that dtype must be what the target really does natively (checked by the test).
"""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    use_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    amp_dtype = torch.bfloat16 if use_bf16 else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=not use_bf16)
    print(f"autocast dtype: {amp_dtype}", flush=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 40), nn.GELU(), nn.Linear(40, 2)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 20, device="cuda")
    y = (x.sum(dim=1) > 0).long()
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast(device_type="cuda", dtype=amp_dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    print("RESULT " + json.dumps({"losses": losses, "info": {"bf16_native": use_bf16, "amp_dtype": str(amp_dtype)}}),
          flush=True)


if __name__ == "__main__":
    main()
