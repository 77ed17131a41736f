"""Classifier backbones, built by name from the dataset's input shape and class count.

Every model is a :class:`FedModel`: ``features(x)`` (everything before the last fully-connected layer,
DaFKD Sec. 3.4 / Fig. 2) then ``head`` (Linear(feature_dim, num_classes)).

- ``lenet5``: LeNet-5 (FedKF Sec. VI-A on EMNIST), 84-d features.
- ``resnet8``: FedKF's ResNet-8 with GroupNorm, one channel per group (FedKF Sec. VI-A), 64-d features
  (``resnet8_bn`` below is the BatchNorm one).
- ``resnet11``: DaFKD's bottleneck "ResNet11" with BatchNorm (DaFKD Sec. 4.1), 256-d features.
- ``mlp``: two hidden layers of 200 ReLU units (McMahan et al.'s "2NN", AISTATS 2017), 200-d features.
- ``vgg_small``: a small VGG with BatchNorm (Simonyan & Zisserman, ICLR 2015), 256-d features.
- ``resnet18``: torchvision's ResNet-18 (He et al., CVPR 2016) with a 3x3 stride-1 stem and no
  max-pool, 512-d features.
- ``mobilenet_v3_small``: torchvision's MobileNetV3-Small (Howard et al., ICCV 2019) with a stride-1
  stem on small images and no dropout, 1024-d features.
- ``resnet8_bn``, ``resnet14``, ``resnet20``, ``resnet32``, ``resnet44``, ``resnet56``, ``resnet110``:
  He et al.'s (CVPR 2016) 6n+2 basic-block CIFAR ResNets with BatchNorm, 16/32/64 channels, 1x1-conv
  projection shortcuts, 64-d features; ``resnet8x4``, ``resnet32x4``: the 4x-wide variants (stem 32,
  stages 64/128/256), 256-d features. Names and widths are those of the model zoo of Tian et al.
  ("Contrastive Representation Distillation", ICLR 2020) that FedCD's Table I uses.
- ``resnet50``: torchvision's bottleneck ResNet-50 (He et al.) with a 3x3 stride-1 stem and no max-pool,
  2048-d features (FedCD's tenth user; the same network as in Tian et al.'s zoo).

The registry (names, builders, descriptions) is in :mod:`fedray.models.zoo`; :func:`describe_models`
lists parameter counts and feature sizes for a given input shape.
"""

from __future__ import annotations

from fedray.models.base import FedModel, disable_inplace
from fedray.models.lenet import LeNet5
from fedray.models.mlp import MLP
from fedray.models.resnet import (BasicBlock, Bottleneck, ResNet8, ResNet8BN, ResNet8x4, ResNet11, ResNet14,
                                  ResNet20, ResNet32, ResNet32x4, ResNet44, ResNet56, ResNet110)
from fedray.models.vgg import VGGSmall
from fedray.models.zoo import MODEL_NAMES, build_model, describe_models, forward_flops

# Defined on torchvision's classes: imported on first use (see fedray.models.zoo._lazy).
_LAZY = {"MobileNetV3Small": "fedray.models.mobilenet", "ResNet18": "fedray.models.resnet18",
         "ResNet50": "fedray.models.resnet50"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODEL_NAMES",
    "MLP",
    "BasicBlock",
    "Bottleneck",
    "FedModel",
    "LeNet5",
    "MobileNetV3Small",
    "ResNet8",
    "ResNet8BN",
    "ResNet8x4",
    "ResNet11",
    "ResNet14",
    "ResNet18",
    "ResNet20",
    "ResNet32",
    "ResNet32x4",
    "ResNet44",
    "ResNet50",
    "ResNet56",
    "ResNet110",
    "VGGSmall",
    "build_model",
    "describe_models",
    "disable_inplace",
]
