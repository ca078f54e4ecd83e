# pattern: small GAN in the DCGAN-tutorial style: device = cuda:0 if available and ngpu > 0, DataParallel only if device.type == "cuda" and ngpu > 1, BCELoss, fixed noise
# launch: hal run
# twin: --ngpu 0
# compare: exact
# expect: ok
"""A fully-connected GAN trained on random "images", structured like the DCGAN tutorial.

    python dcgan_tiny.py            # cuda:0
    python dcgan_tiny.py --ngpu 0   # the tutorial's own CPU switch: the twin
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.optim as optim

parser = argparse.ArgumentParser()
parser.add_argument("--ngpu", type=int, default=1)
parser.add_argument("--nz", type=int, default=8)
parser.add_argument("--iters", type=int, default=3)
opt = parser.parse_args()

manualSeed = 999
torch.manual_seed(manualSeed)
device = torch.device("cuda:0" if (torch.cuda.is_available() and opt.ngpu > 0) else "cpu")
image_size = 4 * 4


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Linear") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(opt.nz, 32), nn.ReLU(True), nn.Linear(32, image_size), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(nn.Linear(image_size, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, input):
        return self.main(input)


netG = Generator(opt.ngpu).to(device)
if (device.type == "cuda") and (opt.ngpu > 1):
    netG = nn.DataParallel(netG, list(range(opt.ngpu)))
netG.apply(weights_init)
netD = Discriminator(opt.ngpu).to(device)
if (device.type == "cuda") and (opt.ngpu > 1):
    netD = nn.DataParallel(netD, list(range(opt.ngpu)))
netD.apply(weights_init)

criterion = nn.BCELoss()
fixed_noise = torch.randn(8, opt.nz, device=device)
real_label, fake_label = 1.0, 0.0
optimizerD = optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
real_images = torch.rand(64, image_size, generator=torch.Generator().manual_seed(3)) * 2 - 1

G_losses, D_losses = [], []
for i in range(opt.iters):
    real_cpu = real_images[i * 16:(i + 1) * 16].to(device)
    b_size = real_cpu.size(0)
    netD.zero_grad()
    label = torch.full((b_size,), real_label, dtype=torch.float, device=device)
    errD_real = criterion(netD(real_cpu).view(-1), label)
    errD_real.backward()
    noise = torch.randn(b_size, opt.nz, device=device)
    fake = netG(noise)
    label.fill_(fake_label)
    errD_fake = criterion(netD(fake.detach()).view(-1), label)
    errD_fake.backward()
    optimizerD.step()

    netG.zero_grad()
    label.fill_(real_label)
    errG = criterion(netD(fake).view(-1), label)
    errG.backward()
    optimizerG.step()
    G_losses.append(errG.item())
    D_losses.append((errD_real + errD_fake).item())

with torch.no_grad():
    sample = netG(fixed_noise).detach().cpu()
print("RESULT " + json.dumps({
    "G_losses": G_losses,
    "D_losses": D_losses,
    "sample_checksum": sample.double().sum().item(),
}), flush=True)
