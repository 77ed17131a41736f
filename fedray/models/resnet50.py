"""torchvision's ResNet-50 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016), adapted
to small images exactly as :mod:`fedray.models.resnet18` adapts ResNet-18.

FedCD (Table I) gives one of its ten users a "ResNet50" next to the CIFAR ResNets of the
knowledge-distillation model zoo of Tian et al. ("Contrastive Representation Distillation", ICLR 2020);
that zoo's ResNet-50 is this network: the ImageNet bottleneck ResNet-50 with a 3x3 stride-1 stem and no
max-pool.

What is torchvision's: the four stages ``layer1``..``layer4`` of 3/4/6/3 bottleneck blocks (1x1 reduce,
3x3 with the stage's stride, 1x1 expand x4; planes 64/128/256/512, outputs 256/512/1024/2048; 1x1 conv +
BN projection shortcuts where the shape changes, i.e. the first block of every stage), BatchNorm, the
adaptive average pool, parameter names (``fc`` is our ``head``) and initialisation (He-normal fan_out
convolutions, BN weight 1 / bias 0, PyTorch's default for the linear layer; no zero-init of the last BN).

What is adapted, and why (as for ResNet-18):

- The stem is a 3x3 stride-1 convolution with the dataset's channel count and 64 outputs, instead of a
  7x7 stride-2 convolution on 3 channels, and there is no max-pool, so a 32x32 image reaches ``layer4``
  at 4x4 rather than 1x1.
- Every activation is out-of-place and each block adds its shortcut out-of-place
  (:class:`OutOfPlaceBottleneck`), so ``torch.func`` transforms (vmap over stacked client weights) work.
- ``head`` = Linear(2048, num_classes); ``features(x)`` is the pooled 2048-d vector.

Depth 50 = the stem + 16 blocks x 3 convolutions + the head (projection shortcuts not counted). With
3x32x32 inputs and 100 classes it has 23,705,252 parameters (torchvision's 25,557,032 with the ImageNet
stem and 1000 classes, less 9,408 - 1,728 for the stem and 2,049,000 - 204,900 for the head).
"""

from __future__ import annotations

from torch import Tensor
from torchvision.models import resnet as tv_resnet

from fedray.models.base import disable_inplace
from fedray.models.resnet18 import SmallImageResNet


class OutOfPlaceBottleneck(tv_resnet.Bottleneck):
    """torchvision's Bottleneck (same submodules and parameter names) with an out-of-place forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        disable_inplace(self)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet50(SmallImageResNet):
    """ResNet-50 with a 3x3 stride-1 stem and no max-pool; ``features`` = pooled 2048-d, ``head`` = Linear(2048, C)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes, OutOfPlaceBottleneck, [3, 4, 6, 3])
