"""Clients made on demand: a client's data derived when it is sampled or evaluated, from the run's seed and its id, in
O(its own size), so that what is kept for every registered client is two numbers (its train and test sizes, in
arrays) and the dataset does not grow with the clients registered.

Two sources, each a function of (seed, client id) alone, so that a client's data is the same whenever, wherever and in
whichever order it is derived (in process, on Ray's workers, after a resume):

- :class:`SampledClients` (the ``on_demand`` partition): client k draws its class mixture from Dirichlet(alpha) and
  its examples from the fixed-size base dataset, each a class drawn from its mixture and then an example of that class
  uniformly, with replacement (two clients may share an image; one client may hold an image twice). Its size is drawn
  up front for every client (all sizes from one stream, vectorised: the system's clock and the sampling weights need
  them): ``mean_size`` (default: the base dataset's examples over the registered clients, at least ``min_size``)
  scaled by a log-normal factor of mean 1 and log-std ``size_sigma``, at least ``min_size``. Its local test split is
  ``test_fraction`` of its draws, rounded as :func:`~fedray.data.partition.split_train_test` rounds (both sizes kept: the only per-client
  arrays).
- :class:`PseudoClients` (TensorFlow Federated's EMNIST "infinite" clients, ``tff.simulation.datasets.emnist``'s
  pseudo-clients): N clients made from the K clients of an eager partition of a real dataset; client k is base client
  k mod K with every image of it moved by the same seeded affine warp (a rotation, a scale, a shear and a translation
  drawn for client k), so a pseudo-client keeps its base client's label mix and size, and the warp alone tells two
  pseudo-clients of one base client apart.

A source counts its derivations (:attr:`derivations`), one per client per call of :meth:`client`: what a run derives
is the clients it sampled plus those it evaluated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

#: Seed stream ids (next to fedray.data.federated's), so that one source's draws never shift another's.
SIZE_STREAM = 11
CLIENT_STREAM = 12
WARP_STREAM = 13


@dataclass
class ClientData:
    """One client's data: uint8 NCHW images and int64 labels, its training then its local test examples."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


@dataclass
class SampledClients:
    """The ``on_demand`` partition (module docstring): ``num_clients`` clients over ``base_x`` / ``base_y``."""

    base_x: np.ndarray  # uint8 (N, C, H, W): the fixed-size base dataset
    base_y: np.ndarray  # int64 (N,)
    num_classes: int
    num_clients: int
    seed: int
    alpha: float
    test_fraction: float = 0.2
    mean_size: int | None = None
    size_sigma: float = 0.5
    min_size: int = 2
    sizes: np.ndarray = field(init=False)  # int32 (K,): each client's examples, train and test
    tests: np.ndarray = field(init=False)  # int32 (K,): of them, its local test examples
    derivations: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        mean = self.mean_size or max(self.min_size, len(self.base_y) // self.num_clients)
        rng = np.random.default_rng([self.seed, SIZE_STREAM])
        # log-normal with mean 1: exp(N(-s^2/2, s^2)), so the sizes average to the base's mean client size
        factor = np.exp(rng.normal(-self.size_sigma ** 2 / 2, self.size_sigma, self.num_clients))
        self.sizes = np.maximum(self.min_size, np.rint(mean * factor)).astype(np.int32)
        # split_train_test's rounding: at least 1 of 2 or more, at most n - 1
        n = self.sizes.astype(np.int64)
        self.tests = np.where(n < 2, 0, np.minimum(n - 1, np.maximum(1, np.rint(n * self.test_fraction)))
                              ).astype(np.int32)
        order = np.argsort(self.base_y, kind="stable")
        bounds = np.searchsorted(self.base_y[order], np.arange(self.num_classes + 1))
        self._pools = [order[bounds[c] : bounds[c + 1]] for c in range(self.num_classes)]
        self._present = np.array([len(p) > 0 for p in self._pools])

    def train_sizes(self) -> np.ndarray:
        return self.sizes - self.tests

    def test_sizes(self) -> np.ndarray:
        return self.tests

    def indices(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``k``'s (train, test) rows of the base dataset, from (seed, k) alone."""
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} of {self.num_clients}")
        rng = np.random.default_rng([self.seed, CLIENT_STREAM, k])
        mixture = rng.dirichlet(np.full(self.num_classes, self.alpha)) * self._present
        mixture = mixture / mixture.sum() if mixture.sum() > 0 else self._present / self._present.sum()
        n = int(self.sizes[k])
        labels = rng.choice(self.num_classes, size=n, p=mixture)
        rows = np.empty(n, dtype=np.int64)
        for c in np.unique(labels):
            at = labels == c
            rows[at] = self._pools[c][rng.integers(0, len(self._pools[c]), int(at.sum()))]
        t = int(self.tests[k])
        return rows[: n - t], rows[n - t :]

    def client(self, k: int) -> ClientData:
        """Client ``k``'s data (one derivation)."""
        self.derivations += 1
        train, test = self.indices(k)
        return ClientData(self.base_x[train], self.base_y[train], self.base_x[test], self.base_y[test])


@dataclass
class PseudoClients:
    """``num_clients`` pseudo-clients of the eager partition ``base_train`` / ``base_test`` (index lists into ``x`` /
    ``y``, one pair per base client): module docstring. ``max_rotation`` in degrees; ``max_scale``, ``max_shear`` and
    ``max_shift`` (a share of the image side) bound the warp's draws, each uniform in [-max, max] (a scale 1 + s)."""

    x: np.ndarray
    y: np.ndarray
    base_train: list[np.ndarray]
    base_test: list[np.ndarray]
    num_clients: int
    seed: int
    max_rotation: float = 15.0
    max_scale: float = 0.1
    max_shear: float = 0.1
    max_shift: float = 0.1
    derivations: int = field(init=False, default=0)

    @property
    def num_base(self) -> int:
        return len(self.base_train)

    def base_of(self, k: int) -> int:
        return k % self.num_base

    def train_sizes(self) -> np.ndarray:
        base = np.array([len(t) for t in self.base_train], dtype=np.int32)
        return base[np.arange(self.num_clients) % self.num_base]

    def test_sizes(self) -> np.ndarray:
        base = np.array([len(t) for t in self.base_test], dtype=np.int32)
        return base[np.arange(self.num_clients) % self.num_base]

    def warp(self, k: int) -> torch.Tensor:
        """Client ``k``'s 2x3 affine matrix (``F.affine_grid``'s, in normalised coordinates), from (seed, k) alone;
        client k < K (the base clients themselves) is warped too: every client is a pseudo-client."""
        if not 0 <= k < self.num_clients:
            raise IndexError(f"client {k} of {self.num_clients}")
        u = np.random.default_rng([self.seed, WARP_STREAM, k]).uniform(-1.0, 1.0, 5)
        angle = math.radians(self.max_rotation * u[0])
        scale = 1.0 + self.max_scale * u[1]
        shear = self.max_shear * u[2]
        cos, sin = math.cos(angle) / scale, math.sin(angle) / scale
        return torch.tensor([[cos, -sin + shear, 2 * self.max_shift * u[3]],
                             [sin, cos, 2 * self.max_shift * u[4]]], dtype=torch.float32)

    def _warped(self, images: np.ndarray, theta: torch.Tensor) -> np.ndarray:
        if len(images) == 0:
            return images
        x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32)
        grid = F.affine_grid(theta.expand(len(x), 2, 3), list(x.shape), align_corners=False)
        out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        return out.round().clamp(0, 255).to(torch.uint8).numpy()

    def client(self, k: int) -> ClientData:
        """Pseudo-client ``k``'s data (one derivation): its base client's examples under its warp."""
        self.derivations += 1
        b, theta = self.base_of(k), self.warp(k)
        train, test = self.base_train[b], self.base_test[b]
        return ClientData(self._warped(self.x[train], theta), self.y[train], self._warped(self.x[test], theta),
                          self.y[test])


__all__ = ["ClientData", "PseudoClients", "SampledClients"]
