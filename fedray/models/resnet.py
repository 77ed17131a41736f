"""Residual backbones of the papers: FedKF's ResNet-8 with GroupNorm, DaFKD's "ResNet11", and the CIFAR
ResNet family of knowledge-distillation work that FedCD (Table I) gives its users.

All are CIFAR-style ResNets (He et al., CVPR 2016, cited as [32] by FedKF and [10] by DaFKD): a 3x3
stem at full resolution (no 7x7 conv, no max-pool), three stages at strides 1/2/2, adaptive average
pooling, and one linear head. The stem follows the input's channel count, and adaptive pooling makes
any spatial size work (28x28, 32x32, 16x16 ...).

The family (:class:`ResNet8BN`, :class:`ResNet14`, :class:`ResNet20`, :class:`ResNet32`,
:class:`ResNet44`, :class:`ResNet56`, :class:`ResNet110`, :class:`ResNet8x4`, :class:`ResNet32x4`) is
He et al.'s 6n+2 basic-block CIFAR ResNet with BatchNorm at the depths and widths of the model zoo of
Tian et al., "Contrastive Representation Distillation" (ICLR 2020), which later distillation papers,
FedCD among them, reuse by name. FedCD's tenth model, ResNet-50, is the bottleneck ImageNet network
adapted to small images (:mod:`fedray.models.resnet50`).

Everything before the head is the shared extractor of DaFKD Sec. 3.4 / Fig. 2 (``FedModel.features``).
Activations and residual additions are out-of-place so that ``torch.func`` transforms and deep copies
behave; there is no dropout.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn
from torch.nn import functional as F

from fedray.models.base import FedModel

NormFactory = Callable[[int], nn.Module]


def group_norm_per_channel(channels: int) -> nn.GroupNorm:
    """GroupNorm with one channel per group (FedKF Sec. VI-A: "set the number of channels of each group as 1")."""
    return nn.GroupNorm(num_groups=channels, num_channels=channels)


def batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels)


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _projection(in_ch: int, out_ch: int, stride: int, norm: NormFactory) -> nn.Sequential | None:
    """1x1 conv + norm shortcut when the shape changes (He et al.'s option B), else the identity (None)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False), norm(out_ch))


def _init_weights(model: nn.Module) -> None:
    """He-normal (fan_out) convolutions, unit-scale zero-shift norms; linears keep PyTorch's default.

    Matches both authors' code (FedKF: normal(0, sqrt(2 / (k*k*out))); DaFKD: kaiming_normal_ fan_out).
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """conv3x3-norm-ReLU-conv3x3-norm, plus the (projected) input, then ReLU."""

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int, norm: NormFactory):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = _conv3x3(in_ch, planes, stride)
        self.norm1 = norm(planes)
        self.conv2 = _conv3x3(planes, out_ch)
        self.norm2 = norm(out_ch)
        self.shortcut = _projection(in_ch, out_ch, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """DaFKD's bottleneck: three **3x3** convolutions (planes, planes with the stride, 4 * planes), each
    followed by a norm, ReLU between them, a 1x1 projection shortcut when the shape changes, ReLU after
    the sum. The DaFKD authors' code uses 3x3 kernels where torchvision's bottleneck has its two 1x1
    convolutions; we follow their code."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int, norm: NormFactory):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = _conv3x3(in_ch, planes)
        self.norm1 = norm(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.norm2 = norm(planes)
        self.conv3 = _conv3x3(planes, out_ch)
        self.norm3 = norm(out_ch)
        self.shortcut = _projection(in_ch, out_ch, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = F.relu(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + identity)


class _CifarResNet(FedModel):
    """Stem conv3x3 + norm + ReLU, three stages (strides 1/2/2), adaptive avg-pool, Linear head.

    The stem has ``stem_width`` channels (default ``widths[0]``, He et al.'s CIFAR layout); stage ``i``
    has ``blocks_per_stage[i]`` blocks of ``widths[i]`` planes, the first one with the stage's stride.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        block: type[BasicBlock] | type[Bottleneck],
        blocks_per_stage: tuple[int, int, int],
        widths: tuple[int, int, int],
        norm: NormFactory,
        stem_width: int | None = None,
    ):
        super().__init__(input_shape, num_classes)
        in_ch = self.input_shape[0]
        stem_ch = widths[0] if stem_width is None else stem_width
        self.stem = nn.Sequential(_conv3x3(in_ch, stem_ch), norm(stem_ch), nn.ReLU())
        stages = []
        ch = stem_ch
        for planes, n_blocks, stride in zip(widths, blocks_per_stage, (1, 2, 2)):
            layers = []
            for i in range(n_blocks):
                layers.append(block(ch, planes, stride if i == 0 else 1, norm))
                ch = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = ch
        self.head = nn.Linear(ch, self.num_classes)
        _init_weights(self)

    def features(self, x: Tensor) -> Tensor:
        return self.pool(self.stages(self.stem(x))).flatten(1)


class ResNet8(_CifarResNet):
    """FedKF's ResNet-8 (FedKF Sec. VI-A): He et al.'s CIFAR ResNet with n=1 (6n + 2 = 8 layers) and
    GroupNorm with one channel per group in place of every BatchNorm.

    FedKF Sec. VI-A says only "ResNet-8 [32]" (He et al.) and that "we replace BN with Group
    Normalization (GN) ... and set the number of channels of each group as 1", because BN running
    statistics fail on heterogeneous client data. What we chose:

    - conv3x3 stem (``base_width`` = 16 channels) + GN + ReLU; three stages of one BasicBlock each with
      16/32/64 channels at strides 1/2/2; adaptive average pooling; 64-d features; head Linear(64, C).
      The widths 16/32/64 are He et al.'s CIFAR ResNet ([32]). The FedKF authors' public code uses
      64/128/256 instead (256-d features); pass ``base_width=64`` to get that network.
    - Every norm is ``GroupNorm(num_groups=channels, num_channels=channels)`` (instance-norm-like, with
      affine parameters and no running statistics), including the shortcut's.
    - Shortcuts are identity where shapes match and 1x1 conv + GN otherwise (He et al.'s option B, as
      in the FedKF authors' code), not option A's zero padding.
    - He-normal (fan_out) conv init, GN weight 1 / bias 0, bias-free convs.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, *, base_width: int = 16):
        widths = (base_width, 2 * base_width, 4 * base_width)
        super().__init__(input_shape, num_classes, BasicBlock, (1, 1, 1), widths, group_norm_per_channel)


class ResNet11(_CifarResNet):
    """DaFKD's backbone, "ResNet11" in the paper (DaFKD Sec. 4.1) and its authors' code.

    conv3x3 stem (16 channels) + BatchNorm + ReLU; three stages of two :class:`Bottleneck` blocks
    (planes 16/32/64, strides 1/2/2, expansion 4, 3x3 convolutions, BN); adaptive average pooling to
    256-d features; head Linear(256, C). DaFKD Sec. 3.4 / Fig. 2 shares everything before this head with
    the domain discriminator, whose head is Linear(256, 1) + sigmoid. The authors' loaders feed 3x32x32
    images; here the stem follows the dataset's channels and adaptive pooling any image size.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes, Bottleneck, (2, 2, 2), (16, 32, 64), batch_norm)


class _BasicCifarResNet(_CifarResNet):
    """The CIFAR ResNet family of knowledge-distillation work: depth ``DEPTH`` = 6n + 2 with n basic
    blocks (:class:`BasicBlock`) per stage, BatchNorm, a ``STEM_WIDTH``-channel conv3x3 stem and stages
    of ``WIDTHS`` channels at strides 1/2/2 (He et al., CVPR 2016, Sec. 4.2; Tian et al., "Contrastive
    Representation Distillation", ICLR 2020, whose model zoo has these names and widths).

    The depth counts the weighted layers on the main path: the stem, 2 convolutions per block (6n) and
    the linear head; the 1x1 projection shortcuts are not counted, as in He et al.

    Shortcuts are He et al.'s option B, a 1x1 conv + BatchNorm projection wherever a block changes the
    shape (the first block of stages 2 and 3, and of stage 1 too in the 4x-wide variants, where the stem
    is narrower than the stage), identity elsewhere. He et al.'s own CIFAR experiments used option A
    (zero padding, no parameters); the distillation zoo that FedCD's names come from uses option B, so
    parameter counts and the shortcut's learned weights match that zoo (ResNet-20 differs from option A
    by 2,752 parameters). Option B also lets the x4 variants' stage 1 widen the stem 32 -> 64.

    He-normal (fan_out) conv init, BN weight 1 / bias 0, bias-free convs, PyTorch's default for the
    head, as in that zoo. The stem takes the dataset's channels and adaptive average pooling replaces the
    fixed 8x8 pool, so any image size works; ``features`` is the pooled ``WIDTHS[-1]``-d vector.
    """

    DEPTH: int
    WIDTHS: tuple[int, int, int] = (16, 32, 64)
    STEM_WIDTH: int = 16

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        if (self.DEPTH - 2) % 6:
            raise ValueError(f"basic-block CIFAR ResNet depth must be 6n+2, got {self.DEPTH}")
        n = (self.DEPTH - 2) // 6
        super().__init__(input_shape, num_classes, BasicBlock, (n, n, n), self.WIDTHS, batch_norm,
                         stem_width=self.STEM_WIDTH)


class ResNet8BN(_BasicCifarResNet):
    """CIFAR ResNet-8 with BatchNorm (n = 1; 16/32/64 channels; 64-d features): the distillation zoo's
    ``resnet8``. :class:`ResNet8` is FedKF's GroupNorm variant of the same layout."""

    DEPTH = 8


class ResNet14(_BasicCifarResNet):
    """CIFAR ResNet-14 (n = 2; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 14


class ResNet20(_BasicCifarResNet):
    """CIFAR ResNet-20 (n = 3; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 20


class ResNet32(_BasicCifarResNet):
    """CIFAR ResNet-32 (n = 5; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 32


class ResNet44(_BasicCifarResNet):
    """CIFAR ResNet-44 (n = 7; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 44


class ResNet56(_BasicCifarResNet):
    """CIFAR ResNet-56 (n = 9; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 56


class ResNet110(_BasicCifarResNet):
    """CIFAR ResNet-110 (n = 18; 16/32/64 channels; 64-d features), BatchNorm, option-B shortcuts."""

    DEPTH = 110


class ResNet8x4(_BasicCifarResNet):
    """ResNet-8x4 of Tian et al.'s zoo: ResNet-8 (n = 1) made 4x wider in its stages, a 32-channel stem
    (2x, as in that zoo) and stages of 64/128/256 channels; 256-d features; BatchNorm, option-B
    shortcuts (stage 1 projects the 32-channel stem to 64)."""

    DEPTH = 8
    WIDTHS = (64, 128, 256)
    STEM_WIDTH = 32


class ResNet32x4(_BasicCifarResNet):
    """ResNet-32x4 of Tian et al.'s zoo: ResNet-32 (n = 5) with a 32-channel stem and stages of
    64/128/256 channels; 256-d features; BatchNorm, option-B shortcuts."""

    DEPTH = 32
    WIDTHS = (64, 128, 256)
    STEM_WIDTH = 32
