"""Writes gpu_checkpoint.pt, the checkpoint resume_gpu_checkpoint.py fine-tunes from.

    python tests/migration_corpus/data/make_gpu_checkpoint.py            # on a machine with 2 GPUs
    python tests/migration_corpus/data/make_gpu_checkpoint.py --emulate  # anywhere: same file, tags forged

Weights and Adam state live on cuda:0 and an EMA copy of the weights on cuda:1, so the file's
storages are tagged "cuda:0" and "cuda:1" as a checkpoint written by real 2-GPU training is.
Without a GPU, --emulate trains on the host and writes the same tags through
torch.serialization.location_tag (the only thing a GPU changes in the file); "device_name" in
the file says which way it was made. The committed file was made with --emulate (no GPU was at
hand); regenerating it on GPUs changes no expectation - resume_gpu_checkpoint.py compares with
its own --cpu twin on whatever file is there.

Not part of the corpus (the harness runs only the scripts directly under migration_corpus/).
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.serialization

parser = argparse.ArgumentParser()
parser.add_argument("--emulate", action="store_true", help="no GPU: forge the cuda:0/cuda:1 storage tags")
args = parser.parse_args()
dev0, dev1 = ("cpu", "cpu") if args.emulate else ("cuda:0", "cuda:1")

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev0)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
for _ in range(2):
    x = torch.randn(32, 8, generator=g).to(dev0)
    y = torch.randint(0, 2, (32,), generator=g).to(dev0)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
ema = {k: v.detach().clone().to(dev1) for k, v in model.state_dict().items()}
checkpoint = {
    "step": 2,
    "model": model.state_dict(),
    "optimizer": optimizer.state_dict(),
    "ema": ema,
    "torch_version": str(torch.__version__),
    "device_name": "emulated (storage tags forged on the host)" if args.emulate else torch.cuda.get_device_name(0),
}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_checkpoint.pt")
if args.emulate:
    on_1 = {v.untyped_storage().data_ptr() for v in ema.values()}
    real_tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:1" if storage.data_ptr() in on_1 else "cuda:0"
    try:
        torch.save(checkpoint, path)
    finally:
        torch.serialization.location_tag = real_tag
else:
    torch.save(checkpoint, path)
print("wrote", path, "-", checkpoint["device_name"], torch.__version__)
