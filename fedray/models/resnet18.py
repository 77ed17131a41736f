"""torchvision's ResNet-18 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016), adapted
to small images the usual way for CIFAR-sized inputs.

What is torchvision's: the four stages ``layer1``..``layer4`` of two BasicBlocks each (64/128/256/512
channels, strides 1/2/2/2, 1x1 conv + BN projection shortcuts where the shape changes), BatchNorm, the
adaptive average pool and torchvision's initialisation (He-normal fan_out convolutions, BN weight 1 /
bias 0, PyTorch's default for the linear layer). Parameter names are torchvision's (``conv1``, ``bn1``,
``layer1.0.conv1`` ..., ``layer2.0.downsample.0`` ...) except that ``fc`` is called ``head``.

What is adapted, and why:

- The stem is a 3x3 stride-1 convolution with the dataset's channel count instead of a 7x7 stride-2
  convolution on 3 channels, and there is no max-pool: on 16-32 px images the ImageNet stem would
  shrink the map 4x before the first block (a 32x32 image would reach ``layer4`` at 1x1).
- Every activation is out-of-place and each block adds its shortcut out-of-place
  (:class:`OutOfPlaceBasicBlock`): torchvision's ``ReLU(inplace=True)`` and ``out += identity`` break
  ``torch.func`` transforms (vmap over stacked client weights), which fedray models must support.
- ``fc`` becomes our ``head`` = Linear(512, num_classes); ``features(x)`` is the pooled 512-d vector.

With 3x32x32 inputs and 10 classes this is the familiar 11,173,962-parameter "CIFAR ResNet-18".
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import resnet as tv_resnet

from fedray.models.base import FedModel, disable_inplace


class OutOfPlaceBasicBlock(tv_resnet.BasicBlock):
    """torchvision's BasicBlock (same submodules and parameter names) with an out-of-place forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        disable_inplace(self)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class SmallImageResNet(FedModel):
    """A torchvision ResNet (``block``, ``layers`` blocks per stage) with a 3x3 stride-1 stem on the
    dataset's channels and no max-pool; ``features`` = the pooled ``512 * block.expansion``-d vector,
    ``head`` = torchvision's ``fc``, Linear(feature_dim, C). Shared by :class:`ResNet18` and
    :class:`fedray.models.resnet50.ResNet50`; ``block`` must have an out-of-place forward."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int,
                 block: type[tv_resnet.BasicBlock] | type[tv_resnet.Bottleneck], layers: list[int]):
        super().__init__(input_shape, num_classes)
        # Build torchvision's network (its stages, init and names), then keep its parts except the stem.
        tv = tv_resnet.ResNet(block, layers, num_classes=self.num_classes)
        self.conv1 = nn.Conv2d(self.input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")  # torchvision's conv init
        self.bn1 = tv.bn1
        self.relu = nn.ReLU()
        self.layer1, self.layer2, self.layer3, self.layer4 = tv.layer1, tv.layer2, tv.layer3, tv.layer4
        self.avgpool = tv.avgpool
        self.feature_dim = tv.fc.in_features
        self.head = tv.fc
        disable_inplace(self)

    def features(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.avgpool(x).flatten(1)


class ResNet18(SmallImageResNet):
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool; ``features`` = pooled 512-d, ``head`` = Linear(512, C)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes, OutOfPlaceBasicBlock, [2, 2, 2, 2])
