"""A small DCGAN-shaped Fabric script (BatchNorm generator and discriminator, noise drawn in the loop).

    python tests/scripts/gan_script.py lightning|minifabric STRATEGY PRECISION OUT.json

The loop has the shape of Lightning Fabric's DCGAN example: a shuffled loader iterated after
``setup_dataloaders``, two models set up separately, the generator's noise drawn from the global
random stream inside the loop, ``fabric.backward`` three times per step. Only the import differs
between the two libraries. Rank 0 writes the per-step losses of both models to OUT.json.
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if sys.argv[1] == "minifabric":
    from minifabric import Accelerator as Fabric
else:
    from lightning_fabric import Fabric

STRATEGY, PRECISION, OUT = sys.argv[2], sys.argv[3], sys.argv[4]
NZ, NGF, NDF, NC = 8, 4, 4, 1


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(  # repeated layers, as Fabric's DCGAN: auto-wrap shards each one
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),  # 4 x 4
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),  # 8 x 8
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False),  # 16 x 16
            nn.Tanh(),
        )

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),  # 8 x 8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),  # 4 x 4
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, NDF * 4, 4, 2, 1, bias=False),  # 2 x 2
            nn.BatchNorm2d(NDF * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 4, 1, 2, 1, 0, bias=False),  # 1 x 1
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x)


def weights_init(m):
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif "BatchNorm" in type(m).__name__:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


def main():
    Fabric.seed_everything(999)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=STRATEGY, precision=PRECISION)
    fabric.launch()
    data = TensorDataset(torch.rand(32, NC, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    generator, discriminator = Generator(), Discriminator()
    generator.apply(weights_init)
    discriminator.apply(weights_init)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(4, NZ, 1, 1, device=fabric.device)
    optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=0.0002, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(generator.parameters(), lr=0.0002, betas=(0.5, 0.999))
    discriminator, optimizer_d = fabric.setup(discriminator, optimizer_d)
    generator, optimizer_g = fabric.setup(generator, optimizer_g)
    loader = fabric.setup_dataloaders(loader)
    losses = []
    for _ in range(2):
        for (real,) in loader:
            discriminator.zero_grad()
            label = torch.full((real.size(0),), 1.0, device=fabric.device)
            err_real = criterion(discriminator(real).view(-1), label)
            fabric.backward(err_real)
            noise = torch.randn(real.size(0), NZ, 1, 1, device=fabric.device)
            fake = generator(noise)
            label.fill_(0.0)
            err_fake = criterion(discriminator(fake.detach()).view(-1), label)
            fabric.backward(err_fake)
            optimizer_d.step()
            generator.zero_grad()
            label.fill_(1.0)
            err_g = criterion(discriminator(fake).view(-1), label)
            fabric.backward(err_g)
            optimizer_g.step()
            losses.append([(err_real + err_fake).item(), err_g.item()])
        with torch.no_grad():  # the example's progress images: the generator on fixed noise
            losses.append([generator(fixed_noise).float().mean().item()] * 2)
        fabric.barrier()
    everyone = fabric.all_gather(torch.tensor(losses))
    if fabric.is_global_zero:
        with open(OUT, "w") as f:
            json.dump(everyone.tolist(), f)
    if sys.argv[1] == "lightning":
        # Lightning's ranks exit with their gloo group alive, and torch then sometimes aborts at
        # interpreter exit ("terminate called without an active exception"). Destroying it right after
        # a collective can deadlock instead (gloo's worker thread needs the GIL to free the finished
        # work). The reference leaves the group the way minifabric does: collect, barrier, destroy.
        from minifabric.runtime.environment import destroy_process_group

        destroy_process_group()


if __name__ == "__main__":
    main()
