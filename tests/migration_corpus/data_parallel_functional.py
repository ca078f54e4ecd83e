# pattern: functional nn.parallel.data_parallel(module, input, range(ngpu)) in the forward pass with ngpu=2, not guarded by device_count()
# launch: hal run
# twin: --cpu
# compare: exact
# expect: warn:data_parallel
"""Functional data parallelism (old DCGAN/pix2pix-style code): the forward calls
``nn.parallel.data_parallel(self.main, input, range(self.ngpu))`` when it runs on CUDA with
--ngpu > 1, trusting the flag rather than torch.cuda.device_count(). On the host the batch cannot
be split over two devices: the numbers are those of one device, and the shim must say so once.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


class Encoder(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(10, 20), nn.LeakyReLU(0.2), nn.Linear(20, 4))

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            return nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        return self.main(input)


parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
parser.add_argument("--ngpu", type=int, default=2)
args = parser.parse_args()
device = torch.device("cpu" if args.cpu else "cuda:0")

torch.manual_seed(0)
model = Encoder(ngpu=args.ngpu).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(5)
losses = []
for _ in range(3):
    x = torch.randn(8, 10, generator=g).to(device)
    y = torch.randint(0, 4, (8,), generator=g).to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())

print("RESULT " + json.dumps({
    "losses": losses,
    "checksum": sum(p.detach().cpu().double().sum().item() for p in model.parameters()),
}), flush=True)
