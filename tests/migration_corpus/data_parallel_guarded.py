# pattern: nn.DataParallel guarded by torch.cuda.device_count() > 1 (the "Optional: Data Parallelism" tutorial)
# launch: hal run
# twin: --cpu
# compare: exact
# expect: ok
"""The Data Parallelism tutorial: wrap in nn.DataParallel only when several GPUs are visible.

On one device the guard keeps the plain module, so nothing is approximated.
"""
import argparse
import json

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class Model(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, input):
        return self.fc(input)


parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
device = torch.device("cpu" if args.cpu else "cuda:0")

torch.manual_seed(0)
rand_loader = DataLoader(dataset=RandomDataset(5, 40), batch_size=10, shuffle=True)
model = Model(5, 2)
wrapped = False
if not args.cpu and torch.cuda.device_count() > 1:
    print("Let's use", torch.cuda.device_count(), "GPUs!")
    model = nn.DataParallel(model)
    wrapped = True
model.to(device)

optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for data in rand_loader:
    input = data.to(device)
    output = model(input)
    loss = output.pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
    "info": {"wrapped": wrapped},
}), flush=True)
