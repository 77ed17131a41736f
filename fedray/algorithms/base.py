"""The algorithm interface of DESIGN.md: broadcast -> client_update -> server_update.

An algorithm is plain PyTorch and never knows where it runs. The runtime builds its modules once per
process (``build_modules``), hands each client a :class:`ClientContext` with that client's data and
seeded generator, ships the ``Payload`` down and the ``Upload`` up, and keeps each client's private
``ClientState`` on the client side (it is never passed to ``server_update``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Iterator, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from fedray.config import ExperimentConfig, FederationConfig
from fedray.data.federated import to_float
from fedray.errors import ConfigError

Weights = dict[str, torch.Tensor]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class DataSpec:
    """What an algorithm may know about the federation's data without seeing any client's samples."""

    input_shape: tuple[int, int, int]
    num_classes: int
    num_clients: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass
class ClientContext:
    """Everything a client update may use: its own data, its seeded randomness, the worker's modules."""

    client_id: int
    round: int
    seed: int
    x: torch.Tensor  # uint8 (N, C, H, W) on ``device``; normalised per batch by ``batches``
    y: torch.Tensor  # int64 (N,)
    spec: DataSpec
    fed: FederationConfig
    device: torch.device
    modules: Any

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])

    def generator(self, purpose: str = "batches") -> torch.Generator:
        from fedray.seeding import derive_seed

        return torch.Generator().manual_seed(derive_seed(self.seed, purpose) % (1 << 63))

    def num_local_steps(self) -> int:
        """``federation.local_steps``, or ``local_epochs`` passes over this client's data when set."""
        if self.fed.local_epochs is not None:
            return self.fed.local_epochs * max(1, -(-self.num_samples // self.fed.batch_size))
        return self.fed.local_steps

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``num_local_steps()`` mini-batches, reshuffling after each pass (a pass may end on a short batch).

        The permutation is drawn on the CPU from this client's seed, so it is the same on every device.
        """
        g = self.generator()
        n, bs = self.num_samples, self.fed.batch_size
        perm, pos = torch.randperm(n, generator=g), 0
        for _ in range(self.num_local_steps()):
            if pos >= n:
                perm, pos = torch.randperm(n, generator=g), 0
            idx = perm[pos : pos + bs].to(self.device)
            pos += bs
            yield to_float(self.x[idx], self.spec.mean, self.spec.std), self.y[idx]


@dataclass
class ServerContext:
    round: int
    seed: int
    device: torch.device
    modules: Any


@dataclass
class ClientResult:
    upload: Any  # sent to the server; counted in comm/bytes_up
    state: Any  # stays client-side; None for stateless methods
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. train/loss, averaged over clients


Params = TypeVar("Params", bound=BaseModel)


class Algorithm(ABC, Generic[Params]):
    """Base class of every method. Subclasses set ``name``, ``Params`` and implement the four steps."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, cfg: ExperimentConfig, spec: DataSpec):
        self.cfg = cfg
        self.spec = spec
        self.params: Params = self.parse_params(cfg.algorithm.params())  # type: ignore[assignment]

    @classmethod
    def parse_params(cls, values: dict[str, Any]) -> BaseModel:
        try:
            return cls.Params.model_validate(values)
        except ValidationError as e:
            err = e.errors()[0]
            key = "algorithm." + ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(f"algorithm.{k}" for k in cls.Params.model_fields) or "none"
                raise ConfigError(key, f"not a parameter of '{cls.name}'; allowed: {allowed}") from None
            raise ConfigError(key, f"{err['msg']} (got {err.get('input')!r})") from None

    # --- built once per process -----------------------------------------------------------------
    @abstractmethod
    def build_modules(self) -> Any:
        """The nn.Modules this method needs in a worker or the server; weights are loaded per call."""

    # --- server side -----------------------------------------------------------------------------
    @abstractmethod
    def init_server_state(self, modules: Any) -> Any:
        """Round-0 server state; ``modules`` were built under the run's ``init`` seed."""

    @abstractmethod
    def broadcast(self, state: Any, round_: int) -> Any:
        """The payload sent to every client sampled in ``round_`` (put in the object store once)."""

    @abstractmethod
    def server_update(self, state: Any, uploads: list[Any], ctx: ServerContext) -> tuple[Any, dict[str, float]]:
        """New server state from this round's uploads (in client-id order) and server metrics."""

    @abstractmethod
    def global_weights(self, state: Any) -> Weights:
        """The weights of the global model that ``eval/*`` evaluates."""

    def extra_eval_models(self, state: Any) -> dict[str, Weights]:
        """Further models to evaluate every evaluation round, by suffix: ``{"oca": w}`` adds
        ``eval/accuracy_oca``, ``eval/amp_oca``, ... beside the ``global_weights`` figures."""
        return {}

    # --- client side -----------------------------------------------------------------------------
    def init_client_state(self, client_id: int) -> Any:
        """A client's private state before its first round (None for stateless methods)."""
        return None

    @abstractmethod
    def client_update(self, ctx: ClientContext, payload: Any, state: Any) -> ClientResult:
        """Local training from the payload and this client's private state."""


# --------------------------------------------------------------------------------------------------
# helpers shared by methods


def clone_weights(module: torch.nn.Module) -> Weights:
    """A detached CPU copy of a module's state dict (what travels between processes)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def weighted_average(weights: list[Weights], coefs: list[float]) -> Weights:
    """sum_k coef_k * w_k, accumulated in the given (client-id) order so every runtime gets the same bits.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are not averaged: the first client's is kept.
    """
    total = float(sum(coefs))
    out: Weights = {}
    for key, ref in weights[0].items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for w, c in zip(weights, coefs):
            acc += w[key].to(torch.float64) * (c / total)
        out[key] = acc.to(ref.dtype)
    return out


def leaves(obj: Any) -> Iterator[Any]:
    """Tensors, arrays and scalars inside a payload/upload (dataclasses, dicts, lists), depth first."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v)
    else:
        yield obj


def _leaf_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    return 8 if isinstance(x, (int, float, bool, np.number)) else 0


def nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in a payload/upload (dataclasses, dicts, lists); scalars count 8."""
    return sum(_leaf_bytes(x) for x in leaves(obj))
