"""The label-conditional generators of the data-free baselines: FedGen's of latent features, FedFTG's of images.

**FeatureGenerator** (FedGen, Zhu et al., ICML 2021; the authors' ``Generator``): G(eps, y) = the input
of a classifier's last layer, so that ``model.head(G(eps, y))`` are logits. [eps, one-hot y] -> Linear(hidden) ->
BatchNorm1d -> ReLU -> Linear(feature_dim). The authors' MNIST/EMNIST sizes: eps 32-d, hidden 256.

**ImageGenerator** (FedFTG, Zhang et al., CVPR 2022; the authors' ``CGeneratorA``): noise and one-hot label each
through a Linear to ``width`` maps of a quarter of the image side, concatenated (2 x width channels), BatchNorm;
upsample x2, conv3x3 2w -> 2w + BatchNorm + LeakyReLU(0.2); upsample x2, conv3x3 2w -> w + BatchNorm + LeakyReLU,
conv3x3 w -> channels, tanh, and a BatchNorm without affine parameters over the output channels, which puts the
images on the zero-mean unit-variance scale a classifier's normalised inputs have. The authors' width is 64 and
noise 100-d (CIFAR-10). Sides not divisible by 4 start at the quarter rounded up and the last upsampling lands on
the exact size (28 -> 7, 14, 28 exactly as the authors' x2 steps).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FeatureGenerator(nn.Module):
    """(eps (B, noise_dim), y (B,) int64) -> latent features (B, feature_dim)."""

    def __init__(self, noise_dim: int, num_classes: int, feature_dim: int, hidden: int = 256):
        super().__init__()
        self.noise_dim, self.num_classes = int(noise_dim), int(num_classes)
        self.body = nn.Sequential(nn.Linear(self.noise_dim + self.num_classes, hidden), nn.BatchNorm1d(hidden),
                                  nn.ReLU(), nn.Linear(hidden, int(feature_dim)))

    def forward(self, eps: Tensor, y: Tensor) -> Tensor:
        return self.body(torch.cat([eps, F.one_hot(y, self.num_classes).to(eps.dtype)], dim=1))


class ImageGenerator(nn.Module):
    """(z (B, noise_dim), y (B,) int64) -> images (B, C, H, W) on a normalised scale."""

    def __init__(self, noise_dim: int, num_classes: int, output_shape: tuple[int, int, int], width: int = 64):
        super().__init__()
        channels, height, width_px = (int(d) for d in output_shape)
        self.noise_dim, self.num_classes = int(noise_dim), int(num_classes)
        self.output_shape = (channels, height, width_px)
        self.base = (math.ceil(height / 4), math.ceil(width_px / 4))
        self.middle = (math.ceil(height / 2), math.ceil(width_px / 2))
        maps = width * self.base[0] * self.base[1]
        self.from_noise = nn.Linear(self.noise_dim, maps)
        self.from_label = nn.Linear(self.num_classes, maps)
        self.norm0 = nn.BatchNorm2d(2 * width)
        self.block1 = nn.Sequential(nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width),
                                    nn.LeakyReLU(0.2))
        self.block2 = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.BatchNorm2d(width),
                                    nn.LeakyReLU(0.2), nn.Conv2d(width, channels, 3, padding=1), nn.Tanh(),
                                    nn.BatchNorm2d(channels, affine=False))

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        onehot = F.one_hot(y, self.num_classes).to(z.dtype)
        out = torch.cat([self.from_noise(z), self.from_label(onehot)], dim=1)
        out = self.norm0(out.view(z.shape[0], -1, *self.base))
        out = self.block1(F.interpolate(out, size=self.middle))
        return self.block2(F.interpolate(out, size=self.output_shape[1:]))
