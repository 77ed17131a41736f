"""torchvision's MobileNetV3-Small (Howard et al., "Searching for MobileNetV3", ICCV 2019), adapted to
small images.

What is torchvision's: the block table (Howard et al., Table 2: eleven inverted-residual bottlenecks with
depthwise 3x3/5x5 convolutions, squeeze-and-excitation and ReLU/hard-swish), the 1x1 conv to 576 channels,
the adaptive average pool, the 576 -> 1024 linear layer with hard-swish, BatchNorm with torchvision's
eps=0.001 and momentum=0.01, and torchvision's initialisation (He-normal fan_out convolutions, BN
weight 1 / bias 0, linears N(0, 0.01) with zero bias).

What is adapted, and why:

- The first convolution takes the dataset's channel count, and its stride is 1 when the image's longer
  side is at most 64 px (2 above): with the ImageNet stride the stem and the four stride-2 bottlenecks
  shrink the map 32x, so a 32x32 image reaches the last blocks at 1x1 (a 16x16 one already halfway);
  with stride 1, 28 and 32 px images end at 2x2 before pooling.
- No dropout: torchvision's classifier has Dropout(0.2) before its last linear layer; fedray models must
  give the same output for the same weights and input, so it is removed.
- Every activation is out-of-place and each bottleneck adds its shortcut out-of-place
  (:class:`OutOfPlaceInvertedResidual`): torchvision's in-place hard-swish/ReLU and ``result += input``
  break ``torch.func`` transforms (vmap over stacked client weights).
- Everything up to the last linear layer is ``features`` (1024-d: pooled 576-d map -> Linear(576, 1024)
  -> hard-swish); the last linear layer is ``head`` = Linear(1024, num_classes).

Module names: torchvision's ``features`` Sequential is ``backbone`` here (``features`` is the
:class:`FedModel` method); ``classifier.0`` keeps its name; ``classifier.3`` is ``head``.

Note that torchvision's BN momentum of 0.01 makes the running statistics (used in eval mode) move
slowly: after few local steps they are still close to their initial values. Kept for faithfulness.
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import mobilenetv3 as tv_mnv3

from fedray.models.base import FedModel, disable_inplace

#: images whose longer side is at most this many pixels get a stride-1 first convolution
SMALL_IMAGE_MAX_SIDE = 64


class OutOfPlaceInvertedResidual(tv_mnv3.InvertedResidual):
    """torchvision's InvertedResidual (same submodules and parameter names) with an out-of-place forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        disable_inplace(self)

    def forward(self, x: Tensor) -> Tensor:
        result = self.block(x)
        return result + x if self.use_res_connect else result


class MobileNetV3Small(FedModel):
    """MobileNetV3-Small; ``features`` = backbone, pool, Linear(576, 1024), hard-swish; ``head`` = Linear(1024, C)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes)
        channels, height, width = self.input_shape
        setting, last_channel = tv_mnv3._mobilenet_v3_conf("mobilenet_v3_small")
        tv = tv_mnv3.MobileNetV3(
            setting, last_channel, num_classes=self.num_classes, block=OutOfPlaceInvertedResidual, dropout=0.0
        )
        self.backbone = tv.features
        stem: nn.Conv2d = self.backbone[0][0]
        stride = 1 if max(height, width) <= SMALL_IMAGE_MAX_SIDE else 2
        new_stem = nn.Conv2d(channels, stem.out_channels, kernel_size=stem.kernel_size, stride=stride,
                             padding=stem.padding, bias=False)
        nn.init.kaiming_normal_(new_stem.weight, mode="fan_out")  # torchvision's conv init
        self.backbone[0][0] = new_stem
        self.avgpool = tv.avgpool
        hidden, activation, _dropout, last = tv.classifier  # Linear(576, 1024), Hardswish, Dropout(0), Linear
        self.classifier = nn.Sequential(hidden, activation)
        self.feature_dim = hidden.out_features
        self.head = last
        disable_inplace(self)

    def features(self, x: Tensor) -> Tensor:
        return self.classifier(self.avgpool(self.backbone(x)).flatten(1))
