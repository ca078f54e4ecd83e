# pattern: AMP with torch.cuda.amp.autocast() + torch.cuda.amp.GradScaler() on a tiny CNN image classifier
# launch: hal run
# twin: --cpu
# compare: rtol=1e-3
# expect: ok
"""Mixed-precision training as the pre-2.4 AMP recipe wrote it (fp16 autocast + dynamic loss scaling).

The --cpu twin runs the same recipe on the host: torch.autocast("cpu", dtype=torch.float16) and
torch.amp.GradScaler("cpu"). fp16 results are compared within rtol 1e-3.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallConvNet(nn.Module):
    def __init__(self, num_classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"

    torch.manual_seed(0)
    model = SmallConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.cpu:
        scaler = torch.amp.GradScaler("cpu")
    else:
        scaler = torch.cuda.amp.GradScaler()

    images = torch.randn(32, 3, 16, 16).to(device)
    labels = torch.randint(0, 5, (32,)).to(device)
    losses, dtypes = [], set()
    for step in range(args.steps):
        optimizer.zero_grad()
        if args.cpu:
            ctx = torch.autocast("cpu", dtype=torch.float16)
        else:
            ctx = torch.cuda.amp.autocast()
        with ctx:
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        dtypes.add(str(logits.dtype))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())

    checksum = sum(p.detach().cpu().double().sum().item() for p in model.parameters())
    print("RESULT " + json.dumps({
        "losses": losses,
        "checksum": checksum,
        "logits_dtype": sorted(dtypes),
        "scale": scaler.get_scale(),
    }), flush=True)


if __name__ == "__main__":
    main()
