"""LeNet-5 (LeCun et al. 1989/1998), the small CNN that FedKF uses on EMNIST (FedKF Sec. VI-A, ref. [31]).

Layout (the form common in FL papers, with max-pooling and ReLU):

    conv5x5(C -> 6) ReLU maxpool2  ->  conv5x5(6 -> 16) ReLU maxpool2  ->  flatten
    -> FC 120 ReLU -> FC 84 ReLU   (= features, 84-d)   ->  head FC(84 -> num_classes)

The first convolution gets padding=2 when the input is 28x28 or smaller, as in the classic MNIST
setting, so that a 28x28 image produces the same 16x5x5 map (400 inputs to FC 120) as an unpadded
32x32 one, and a 16x16 image still fits (16x2x2). The flatten size is computed from the input shape.
With 1x28x28 inputs and 10 classes this is the classic 61,706-parameter network.

Note: the FedKF authors' code ends the extractor with conv5x5(16 -> 120) instead of a flatten + FC 120,
which only fits 32x32 inputs; on 32x32 inputs the two are the same function and have the same
parameter count.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedray.errors import ConfigError
from fedray.models.base import FedModel


def _lenet_map_size(size: int, padding: int) -> int:
    """Spatial size after conv5 (padding p) -> pool2 -> conv5 -> pool2 (floor division, like PyTorch)."""
    size = (size + 2 * padding - 4) // 2
    return (size - 4) // 2


class LeNet5(FedModel):
    """LeNet-5 split as ``features`` (both conv blocks, FC 120 and FC 84) and ``head`` (FC 84 -> C).

    The 84-d output of the second hidden FC layer is the shared extractor's output in the DaFKD sense
    (DaFKD Sec. 3.4 / Fig. 2: everything before the last fully-connected layer).
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int):
        super().__init__(input_shape, num_classes)
        channels, height, width = self.input_shape
        padding = 2 if max(height, width) <= 28 else 0
        map_h, map_w = _lenet_map_size(height, padding), _lenet_map_size(width, padding)
        if map_h < 1 or map_w < 1:
            raise ConfigError(
                "model.name",
                f"lenet5 needs images of at least 12x12, got {height}x{width}; use resnet8 or resnet11",
            )
        self.feature_dim = 84
        self.extractor = nn.Sequential(
            nn.Conv2d(channels, 6, kernel_size=5, padding=padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * map_h * map_w, 120),
            nn.ReLU(),
            nn.Linear(120, self.feature_dim),
            nn.ReLU(),
        )
        self.head = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.extractor(x)
