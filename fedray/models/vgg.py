"""A small VGG-style CNN with BatchNorm (Simonyan & Zisserman, ICLR 2015; BatchNorm as in torchvision's
``vgg*_bn`` variants, after Ioffe & Szegedy, ICML 2015).

Layout (``VGG_SMALL_CFG``, torchvision's ``make_layers`` notation: an int is a conv3x3 with that many
channels followed by BatchNorm + ReLU, "M" a 2x2 max-pool):

    [32, M, 64, M, 128, 128, M]  ->  adaptive avg-pool to 2x2  ->  flatten (512)
    -> FC 256 ReLU   (= features, 256-d)   ->  head FC(256 -> num_classes)

This mirrors torchvision's VGG (conv stack, adaptive average pool, fully-connected classifier) at a size
that suits 16-32 px images: the adaptive pool makes 16x16, 28x28 and 32x32 all give a 2x2 map (torchvision
pools to 7x7 for 224 px images), and the classifier is one hidden FC layer instead of two of 4096 units.
There is no dropout (torchvision's VGG classifier has two; our models must be deterministic), and
activations are out-of-place.

The conv stack is built here rather than with ``torchvision.models.vgg.make_layers`` because that helper
fixes the input to 3 channels and uses in-place ReLUs; the loop below is the same construction with
the dataset's channel count and ``nn.ReLU()``, and keeps its module indices (conv, bn, relu / pool),
so ``conv.N`` here is ``features.N`` there. Initialisation follows torchvision's VGG: He-normal
(fan_out) convolutions with zero bias, BN weight 1 / bias 0, linears N(0, 0.01) with zero bias.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedray.errors import ConfigError
from fedray.models.base import FedModel

VGG_SMALL_CFG: tuple[int | str, ...] = (32, "M", 64, "M", 128, 128, "M")


def vgg_layers(cfg: tuple[int | str, ...], in_channels: int) -> nn.Sequential:
    """torchvision's ``make_layers(cfg, batch_norm=True)`` with ``in_channels`` inputs and out-of-place ReLUs."""
    layers: list[nn.Module] = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            out = int(v)
            layers += [nn.Conv2d(in_channels, out, kernel_size=3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            in_channels = out
    return nn.Sequential(*layers)


class VGGSmall(FedModel):
    """``conv`` stack + ``avgpool`` + ``classifier`` (FC 256, ReLU) as ``features``; ``head`` = Linear(256, C)."""

    POOL = (2, 2)
    HIDDEN = 256

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes)
        channels, height, width = self.input_shape
        n_pools = sum(v == "M" for v in VGG_SMALL_CFG)
        smallest = 2 ** n_pools
        if min(height, width) < smallest:
            # each 2x2 max-pool halves the map; below 8 px the last one would see an empty map
            raise ConfigError(
                "model.name",
                f"vgg_small needs images of at least {smallest}x{smallest}, got {height}x{width}; "
                "use mlp, resnet8 or resnet18",
            )
        self.conv = vgg_layers(VGG_SMALL_CFG, channels)
        last_channels = [v for v in VGG_SMALL_CFG if v != "M"][-1]
        self.avgpool = nn.AdaptiveAvgPool2d(self.POOL)
        flat = int(last_channels) * self.POOL[0] * self.POOL[1]
        self.classifier = nn.Sequential(nn.Linear(flat, self.HIDDEN), nn.ReLU())
        self.feature_dim = self.HIDDEN
        self.head = nn.Linear(self.feature_dim, self.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def features(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.conv(x)).flatten(1))
