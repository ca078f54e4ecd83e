# pattern: AMP with torch.autocast("cuda", dtype=torch.bfloat16) + torch.amp.GradScaler("cuda") on a tiny transformer encoder
# launch: hal run
# twin: --device cpu
# compare: rtol=1e-3
# expect: ok
"""The 2.4+ AMP spelling: device-generic torch.autocast / torch.amp.GradScaler with the device as a string.

    python amp_bf16_autocast.py                  # cuda
    python amp_bf16_autocast.py --device cpu     # the same recipe on the host
"""
import argparse
import json

import torch
import torch.nn as nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = args.device

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(50, 32), nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False),
                          nn.Linear(32, 50)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device)

    tokens = torch.randint(0, 50, (4, 12), device=device)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 50), tokens[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())

    print("RESULT " + json.dumps({
        "losses": losses,
        "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
        "logits_dtype": str(logits.dtype),
    }), flush=True)


if __name__ == "__main__":
    main()
