"""DaFKD's generators (the authors' DCGAN; the paper's conditional fully-connected one) and its separate
(no-sharing) discriminator.

**Generator** (DCGAN, Radford et al. 2016; the DaFKD authors' ``GeneratorCifar``): z in R^nz, seen as a
1x1 map, -> ConvTranspose to ``4w`` channels at a small base size -> three stride-2 ConvTranspose layers
(``2w``, ``w``, then the image's channels), BatchNorm + ReLU after every hidden layer, tanh at the end.
With ``w = 64`` on 3x32x32 images this is the authors' network exactly (base 4x4, three 4x4 stride-2
transposed convolutions). For other shapes each side is halved three times (rounding up) to get the
base size, and each upsampling uses a 4x4 kernel (n -> 2n) or, where the target side is odd, a 3x3
kernel (n -> 2n - 1); on 1x28x28 (Fashion-MNIST, MNIST) that is 1x1 -> 4x4 -> 7x7 -> 14x14 -> 28x28, the
usual DCGAN layout for MNIST, so the output is exactly C x H x W. (A stride-1 last layer at full size,
the other way to reach 28, is 4-5x slower on a CPU for no gain.)

**Output space.** The classifier sees images normalised as ``(pixel/255 - mean) / std``
(:func:`fedray.data.federated.to_float`). The generator's tanh output t in [-1, 1] is read as pixels
p = (t + 1) / 2 in [0, 1] and normalised the same way, ``(p - mean) / std``, inside ``forward``; so real
and generated images reach the classifier and the discriminator in the same space and range.

**Separate discriminator** (DaFKD Table 3, "no-sharing"): the classifier's own architecture with its own
weights and a one-logit head, ``build_model(name, shape, 1)``; it differs from the shared variant
(Sec. 3.4, Fig. 2) only in not sharing the extractor, which is what the ablation isolates.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedray.models import FedModel, build_model


def _stages(size: int) -> tuple[int, list[int]]:
    """Base side and the kernel of each of the three stride-2 upsamplings that end exactly at ``size``."""
    sides = [size]
    for _ in range(3):
        sides.append(-(-sides[-1] // 2))
    sides.reverse()  # base, ..., size
    return sides[0], [4 if out == 2 * inp else 3 for inp, out in zip(sides, sides[1:])]


class DCGANGenerator(nn.Module):
    """z (B, noise_dim) -> images (B, C, H, W) in the classifier's normalised input space."""

    def __init__(self, noise_dim: int, output_shape: tuple[int, int, int], width: int = 64,
                 mean: tuple[float, ...] = (0.5,), std: tuple[float, ...] = (0.5,)):
        super().__init__()
        channels, height, width_px = (int(d) for d in output_shape)
        self.noise_dim = int(noise_dim)
        self.output_shape = (channels, height, width_px)
        # plain tuples, not buffers: configuration, not state (never averaged or sent)
        self.mean = tuple(float(m) for m in mean) * (channels if len(mean) == 1 else 1)
        self.std = tuple(float(s) for s in std) * (channels if len(std) == 1 else 1)
        (base_h, kernels_h), (base_w, kernels_w) = _stages(height), _stages(width_px)
        chans = (4 * width, 2 * width, width, channels)
        layers: list[nn.Module] = [
            nn.ConvTranspose2d(self.noise_dim, chans[0], kernel_size=(base_h, base_w), bias=False),
            nn.BatchNorm2d(chans[0]),
            nn.ReLU(),
        ]
        for i in range(3):
            last = i == 2
            layers.append(nn.ConvTranspose2d(chans[i], chans[i + 1], kernel_size=(kernels_h[i], kernels_w[i]),
                                             stride=2, padding=1, bias=last))
            if not last:
                layers += [nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
        layers.append(nn.Tanh())
        self.net = nn.Sequential(*layers)
        dcgan_init(self)

    conditional = False

    def forward(self, z: Tensor, y: Tensor | None = None) -> Tensor:
        """``y`` (labels) is ignored: this generator is unconditional."""
        return to_input_space(self.net(z.view(z.shape[0], self.noise_dim, 1, 1)), self.mean, self.std)

    def extra_repr(self) -> str:
        return f"noise_dim={self.noise_dim}, output_shape={self.output_shape}"


def to_input_space(t: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """tanh output t in [-1, 1] read as pixels (t + 1) / 2 and normalised like the real data.

    The constants are made on ``t``'s device (scalars, or filled there), never copied from the host: a forward
    with a host-to-device copy cannot be captured in a CUDA graph (``runtime.cuda_graphs``)."""
    p = (t + 1.0) * 0.5
    if len(set(mean)) == 1 and len(set(std)) == 1:
        return (p - mean[0]) / std[0]

    def per_channel(values: tuple[float, ...]) -> Tensor:
        return torch.cat([torch.full((1,), v, dtype=t.dtype, device=t.device) for v in values]).view(1, -1, 1, 1)

    return (p - per_channel(mean)) / per_channel(std)


class ConditionalGenerator(nn.Module):
    """The DaFKD paper's generator (Sec. 4.1, as FedGen's): an embedding of the one-hot label and one of the
    noise vector, concatenated, then fully-connected layers with BatchNorm and LeakyReLU, and a last one to
    C x H x W with tanh (read as pixels and normalised like :class:`DCGANGenerator`). (z, y) -> images of
    class y: the distillation set can then hold every class in equal numbers.

    The paper gives the layer types only; widths here: embeddings of ``hidden`` / 2 each, hidden layers of
    ``hidden`` and 2 ``hidden`` units."""

    conditional = True

    def __init__(self, noise_dim: int, num_classes: int, output_shape: tuple[int, int, int], hidden: int = 256,
                 mean: tuple[float, ...] = (0.5,), std: tuple[float, ...] = (0.5,)):
        super().__init__()
        channels = int(output_shape[0])
        self.noise_dim, self.num_classes = int(noise_dim), int(num_classes)
        self.output_shape = tuple(int(d) for d in output_shape)
        self.mean = tuple(float(m) for m in mean) * (channels if len(mean) == 1 else 1)
        self.std = tuple(float(s) for s in std) * (channels if len(std) == 1 else 1)
        self.label_embedding = nn.Linear(self.num_classes, hidden // 2)
        self.noise_embedding = nn.Linear(self.noise_dim, hidden // 2)
        self.net = nn.Sequential(
            nn.Linear(2 * (hidden // 2), hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 2 * hidden), nn.BatchNorm1d(2 * hidden), nn.LeakyReLU(0.2),
            nn.Linear(2 * hidden, channels * self.output_shape[1] * self.output_shape[2]), nn.Tanh())

    def forward(self, z: Tensor, y: Tensor | None = None) -> Tensor:
        if y is None:
            raise ValueError("the conditional generator needs labels y")
        onehot = nn.functional.one_hot(y, self.num_classes).to(z.dtype)
        h = torch.cat([self.label_embedding(onehot), self.noise_embedding(z)], dim=1)
        return to_input_space(self.net(h).view(z.shape[0], *self.output_shape), self.mean, self.std)

    def extra_repr(self) -> str:
        return f"noise_dim={self.noise_dim}, num_classes={self.num_classes}, output_shape={self.output_shape}"


def dcgan_init(module: nn.Module) -> None:
    """DCGAN's initialisation (Radford et al.): conv weights N(0, 0.02), BN weights N(1, 0.02), bias 0.

    Draws from torch's global RNG, like every model constructor here: seed it first (the runtime builds
    modules under the run's ``init`` seed).
    """
    for m in module.modules():
        if isinstance(m, (nn.ConvTranspose2d, nn.Conv2d)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


def separate_discriminator(model_name: str, input_shape: tuple[int, int, int]) -> FedModel:
    """The no-sharing discriminator: the classifier's architecture, own weights, ``forward`` -> (B, 1) logit."""
    return build_model(model_name, input_shape, 1)
