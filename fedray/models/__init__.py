"""Classifier backbones, built by name from the dataset's input shape and class count.

Every model is a :class:`FedModel`: ``features(x)`` (everything before the last fully-connected layer,
DaFKD Sec. 3.4 / Fig. 2) then ``head`` (Linear(feature_dim, num_classes)).

- ``lenet5``: LeNet-5 (FedKF Sec. VI-A on EMNIST), 84-d features.
- ``resnet8``: FedKF's ResNet-8 with GroupNorm, one channel per group (FedKF Sec. VI-A), 64-d features.
- ``resnet11``: DaFKD's bottleneck "ResNet11" with BatchNorm (DaFKD Sec. 4.1), 256-d features.
"""

from __future__ import annotations

from fedray.errors import ConfigError
from fedray.models.base import FedModel
from fedray.models.lenet import LeNet5
from fedray.models.resnet import Bottleneck, BasicBlock, ResNet8, ResNet11

MODEL_NAMES = ("lenet5", "resnet8", "resnet11")

_BUILDERS = {"lenet5": LeNet5, "resnet8": ResNet8, "resnet11": ResNet11}


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> FedModel:
    """A freshly initialised model ``name`` for images of ``input_shape`` = (C, H, W) and ``num_classes``.

    Initial weights come from torch's global RNG: seed it first for reproducible weights.
    Raises :class:`ConfigError` (key ``model.name``) for an unknown name.
    """
    builder = _BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ConfigError("model.name", f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    return builder(tuple(input_shape), num_classes)


__all__ = [
    "MODEL_NAMES",
    "BasicBlock",
    "Bottleneck",
    "FedModel",
    "LeNet5",
    "ResNet8",
    "ResNet11",
    "build_model",
]
