"""FedKF's local generator: the DAFL generator (Chen et al., ICCV 2019, FedKF ref. [27]) as in the FedKF
authors' code, following the dataset's shape.

    z (noise_dim) -> Linear -> w x ceil(H/4) x ceil(W/4) -> BN
    -> upsample x2 -> conv3x3 w -> BN -> LeakyReLU(0.2)
    -> upsample x2 (to H x W) -> conv3x3 w/2 -> BN -> LeakyReLU(0.2) -> conv3x3 C -> sigmoid
    -> (x - mean) / std        (the dataset normalisation, so samples live where real batches do)

FedKF Sec. VI-A: "a deep convolutional generator ... replace tanh activation function in the last layer
by sigmoid"; the sigmoid gives [0, 1] pixels, normalised like the real data (``to_float``). The two inner
BatchNorms are built as ``BatchNorm2d(ch, 0.8)`` in DAFL's and the FedKF authors' code, which sets
*eps* = 0.8 (not the momentum); we keep it, since it shapes what the generator learns. Conv weights are
initialised N(0, sqrt(2 / (k * k * out))) and BN to (1, 0), as in that code. The first upsampling goes to
ceil(H/2) x ceil(W/2) and the second to exactly H x W, so 28x28 (7 -> 14 -> 28), 32x32 (8 -> 16 -> 32) and
16x16 inputs come out as in the code and any other size still fits. The width w is DAFL's 128 unless asked
(a narrower one for small tests and laptops). No in-place ops (see models/base.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class DAFLGenerator(nn.Module):
    def __init__(self, input_shape: tuple[int, int, int], noise_dim: int = 100,
                 mean: tuple[float, ...] = (0.0,), std: tuple[float, ...] = (1.0,), width: int = 128):
        super().__init__()
        channels, height, img_width = (int(d) for d in input_shape)
        self.input_shape = (channels, height, img_width)
        self.noise_dim = int(noise_dim)
        self.init_hw = (math.ceil(height / 4), math.ceil(img_width / 4))
        self.mid_hw = (math.ceil(height / 2), math.ceil(img_width / 2))
        self.width = w = int(width)
        half = max(1, w // 2)
        self.fc = nn.Linear(self.noise_dim, w * self.init_hw[0] * self.init_hw[1])
        self.bn = nn.BatchNorm2d(w)
        self.block1 = nn.Sequential(nn.Conv2d(w, w, 3, stride=1, padding=1), nn.BatchNorm2d(w, 0.8),
                                    nn.LeakyReLU(0.2))
        self.block2 = nn.Sequential(nn.Conv2d(w, half, 3, stride=1, padding=1), nn.BatchNorm2d(half, 0.8),
                                    nn.LeakyReLU(0.2), nn.Conv2d(half, channels, 3, stride=1, padding=1), nn.Sigmoid())
        mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        # Constants of the dataset, not learned: kept out of the state dict (nothing to average or send).
        self.register_buffer("mean", mean_t, persistent=False)
        self.register_buffer("std", std_t, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / n))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def images(self, z: Tensor) -> Tensor:
        """Samples in [0, 1] pixel space, (B, C, H, W)."""
        x = self.bn(self.fc(z).view(-1, self.width, *self.init_hw))
        x = self.block1(F.interpolate(x, size=self.mid_hw))
        return self.block2(F.interpolate(x, size=self.input_shape[1:]))

    def forward(self, z: Tensor) -> Tensor:
        """Normalised samples (B, C, H, W), the input space of the classifiers."""
        return (self.images(z) - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"input_shape={self.input_shape}, noise_dim={self.noise_dim}, width={self.width}"
