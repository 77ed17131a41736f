"""The model registry: every name ``build_model`` accepts, its builder and a one-line description.

Kept in one table so that ``MODEL_NAMES``, the unknown-name error and :func:`describe_models` (the
``fedray models`` listing) cannot disagree.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple

import torch

from fedray.errors import ConfigError
from fedray.models.base import FedModel
from fedray.models.lenet import LeNet5
from fedray.models.mlp import MLP
from fedray.models.resnet import (ResNet8, ResNet8BN, ResNet8x4, ResNet11, ResNet14, ResNet20, ResNet32,
                                  ResNet32x4, ResNet44, ResNet56, ResNet110)
from fedray.models.vgg import VGGSmall


def _lazy(module: str, name: str) -> Callable[[tuple[int, int, int], int], FedModel]:
    """The builder of a model class defined on top of torchvision's, imported when first built: importing
    torchvision.models imports torch's compiler stack (~2 s of CPU), which a process that never builds
    these (the Ray driver, a FedAvg server actor) should not pay at start-up."""

    def build(input_shape: tuple[int, int, int], num_classes: int) -> FedModel:
        return getattr(importlib.import_module(module), name)(input_shape, num_classes)

    return build


class ZooEntry(NamedTuple):
    builder: Callable[[tuple[int, int, int], int], FedModel]
    description: str


# Insertion order is the order of MODEL_NAMES, of the "allowed:" list in errors and of describe_models.
_ZOO: dict[str, ZooEntry] = {
    "lenet5": ZooEntry(LeNet5, "LeNet-5 (LeCun et al. 1998), FedKF's EMNIST model"),
    "resnet8": ZooEntry(ResNet8, "CIFAR ResNet-8, GroupNorm 1 channel/group (FedKF); BatchNorm: resnet8_bn"),
    "resnet11": ZooEntry(ResNet11, "bottleneck ResNet-11 with BatchNorm (DaFKD)"),
    "mlp": ZooEntry(MLP, "2-hidden-layer MLP, 200-200 ReLU (McMahan et al.'s 2NN)"),
    "vgg_small": ZooEntry(VGGSmall, "small VGG with BatchNorm, 32-64-128-128 convs, FC 256"),
    "resnet18": ZooEntry(_lazy("fedray.models.resnet18", "ResNet18"), "torchvision ResNet-18, 3x3 stem, no max-pool"),
    "mobilenet_v3_small": ZooEntry(_lazy("fedray.models.mobilenet", "MobileNetV3Small"), "torchvision MobileNetV3-Small, stride-1 stem, no dropout"),
    # The CIFAR ResNet family of knowledge-distillation work (Tian et al.'s CRD zoo), FedCD's Table I.
    "resnet8_bn": ZooEntry(ResNet8BN, "CIFAR ResNet-8 (n=1), BatchNorm, 16/32/64 channels"),
    "resnet14": ZooEntry(ResNet14, "CIFAR ResNet-14 (n=2), BatchNorm, 16/32/64 channels"),
    "resnet20": ZooEntry(ResNet20, "CIFAR ResNet-20 (n=3), BatchNorm, 16/32/64 channels"),
    "resnet32": ZooEntry(ResNet32, "CIFAR ResNet-32 (n=5), BatchNorm, 16/32/64 channels"),
    "resnet44": ZooEntry(ResNet44, "CIFAR ResNet-44 (n=7), BatchNorm, 16/32/64 channels"),
    "resnet56": ZooEntry(ResNet56, "CIFAR ResNet-56 (n=9), BatchNorm, 16/32/64 channels"),
    "resnet110": ZooEntry(ResNet110, "CIFAR ResNet-110 (n=18), BatchNorm, 16/32/64 channels"),
    "resnet8x4": ZooEntry(ResNet8x4, "CIFAR ResNet-8x4 (n=1), BatchNorm, stem 32, 64/128/256 channels"),
    "resnet32x4": ZooEntry(ResNet32x4, "CIFAR ResNet-32x4 (n=5), BatchNorm, stem 32, 64/128/256 channels"),
    "resnet50": ZooEntry(_lazy("fedray.models.resnet50", "ResNet50"), "torchvision bottleneck ResNet-50, 3x3 stem, no max-pool"),
}

MODEL_NAMES: tuple[str, ...] = tuple(_ZOO)


def _entry(name: Any) -> ZooEntry:
    entry = _ZOO.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError("model.name", f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    return entry


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> FedModel:
    """A freshly initialised model ``name`` for images of ``input_shape`` = (C, H, W) and ``num_classes``.

    Initial weights come from torch's global RNG: seed it first for reproducible weights.
    Raises :class:`ConfigError` (key ``model.name``) for an unknown name, or for an image too small
    for the architecture (``lenet5`` below 12x12, ``vgg_small`` below 8x8).
    """
    return _entry(name).builder(tuple(input_shape), num_classes)


def forward_flops(name: str, input_shape: tuple[int, int, int], num_classes: int) -> int:
    """FLOPs of one forward pass of one image through ``name`` (counted on the ``meta`` device: no memory,
    no time in initialisation, the global RNG untouched). The Ray runtime balances clients by it."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = _ZOO[name].builder(tuple(input_shape), num_classes).eval()
        x = torch.empty(1, *input_shape)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return int(counter.get_total_flops())


def describe_models(input_shape: tuple[int, int, int], num_classes: int) -> list[dict[str, Any]]:
    """One row per name in ``MODEL_NAMES``, for images of ``input_shape`` and ``num_classes`` classes.

    Each row: ``name``; ``parameters`` (trainable parameter count, int); ``feature_dim`` (int);
    ``description`` (short text); ``error`` (None, or why this architecture cannot take this input, in
    which case ``parameters`` and ``feature_dim`` are None).

    Models are built on the ``meta`` device: no memory for weights, no time in initialisation, and the
    global RNG is left untouched, so calling this does not change later seeded runs.
    """
    rows: list[dict[str, Any]] = []
    for name, entry in _ZOO.items():
        row: dict[str, Any] = {"name": name, "parameters": None, "feature_dim": None,
                               "description": entry.description, "error": None}
        try:
            with torch.device("meta"):
                model = entry.builder(tuple(input_shape), num_classes)
        except ConfigError as err:
            row["error"] = err.message
        else:
            row["parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            row["feature_dim"] = int(model.feature_dim)
        rows.append(row)
    return rows
