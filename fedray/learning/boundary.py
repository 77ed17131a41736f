"""What crosses the client/server boundary, and what a client or server step is given.

These types sit below both the learning helpers and the methods, so both can import them: the four state types a
method subclasses with its own dataclasses (:class:`Payload` down, :class:`Upload` up, :class:`ClientState` kept by
the client, :class:`ServerState` kept by the server), the contexts the runtime hands a client update
(:class:`ClientContext`) and a server update (:class:`ServerContext`), a client's :class:`ClientResult`, and what a
method may know of the data (:class:`DataSpec`, :class:`ServerSideData`, :class:`DiagnosticProbe`). The contract that
uses them is :mod:`fedray.methods.api`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Iterator, TypeVar

import numpy as np
import torch

from fedray.config import FederationConfig
from fedray.data.federated import ClientBatches
from fedray.learning.aggregation import Aggregation, WeightedMean
from fedray.learning.weights import Weights
from fedray.models import build_model
from fedray.models.base import channels_last_if_faster
from fedray.seeding import derive_seed

# --- what crosses the client/server boundary: each method subclasses these with its own dataclasses ---

#: The field metadata key under which a message's field declares how the channel reads it (:func:`model_field`,
#: :func:`values_field`, :func:`counts_field`; docs/channel.md). An undeclared field is read by its tensors' dtype:
#: floating tensors are values, integer tensors counts.
WIRE = "fedray.wire"


def model_field(against: str | None, **kwargs: Any) -> Any:
    """Declare a message field as a model (a tensor, or a dict of tensors such as :data:`Weights`): what it carries
    is weights, and a channel stage that sends updates (compression's error feedback) sends it as the update against
    the payload field ``against`` as the client decoded it (the same key in a dict; an asynchronous ``rebase`` does
    likewise). ``against=None``: a model the payload does not carry (a private discriminator's update is sent
    whole). ``kwargs`` go to :func:`dataclasses.field` (a default, ``repr``...)."""
    return field(metadata={WIRE: ("model", against)}, **kwargs)


def values_field(**kwargs: Any) -> Any:
    """Declare a message field as plain values (logits, generator outputs, scores): transformed as they are."""
    return field(metadata={WIRE: ("values", None)}, **kwargs)


def counts_field(**kwargs: Any) -> Any:
    """Declare a message field as counts (label histograms, sample counts): never transformed by any stage, even
    when stored as floating point."""
    return field(metadata={WIRE: ("counts", None)}, **kwargs)



@dataclass
class Payload:
    """What the server broadcasts to every client sampled in a round (counted in ``comm/bytes_down``)."""


@dataclass
class Upload:
    """What one client sends the server after its local update (counted in ``comm/bytes_up``)."""


@dataclass
class ClientState:
    """A client's private, persistent state (its own model, discriminator, generator); never uploaded."""


@dataclass
class ServerState:
    """The server's state between rounds (global model, caches, buffers); checkpointed."""


@dataclass
class ServerSideData:
    """Data held by the server (``data.server_data``): uint8 images on the server's device, and labels only
    when the run says the server's data is labelled. Clients never see it unless a method sends it."""

    x: torch.Tensor  # uint8 (N, C, H, W); normalise with to_float(x, spec.mean, spec.std)
    y: torch.Tensor | None  # int64 (N,), or None for unlabelled server data
    domain: str | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass
class DiagnosticProbe:
    """Real data a simulation shows a method's diagnostics (``diag/*``) and never its training: a seeded
    subset of the global test set, a few training images of every client, and every client's label counts
    (the Theorem-1-style oracle of which client an image of class y is likely to come from)."""

    test_x: torch.Tensor  # float, normalised (N, C, H, W)
    test_y: torch.Tensor  # int64 (N,)
    client_x: dict[int, torch.Tensor]  # client id -> float, normalised (<= n, C, H, W) of its training images
    label_counts: torch.Tensor  # float (num_clients, num_classes): training samples per client and class
    reader: Any = None  # fedray.reader.Reader when the method scores generated samples (Algorithm.wants_reader)


@dataclass
class PersonalModel(ClientState):
    """A client's own model: its architecture's name and weights (FedCD, the isolated baseline)."""

    client_id: int
    architecture: str
    weights: Weights


@dataclass(frozen=True)
class DataSpec:
    """What an algorithm may know about the federation's data without seeing any client's samples."""

    input_shape: tuple[int, int, int]
    num_classes: int
    num_clients: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


class ModelBank:
    """One module per architecture, built on first use and reused for every client of that architecture
    (a worker swaps clients' weights into it, as it does for a shared model), so a worker's memory grows
    with the architectures it has seen, not with the clients it serves."""

    def __init__(self, spec: DataSpec, device: torch.device, channels_last: bool = False):
        self.spec, self.device = spec, device
        self.channels_last = channels_last  # runtime.cpu_channels_last, on a CPU
        self._modules: dict[str, torch.nn.Module] = {}

    def get(self, architecture: str) -> torch.nn.Module:
        if architecture not in self._modules:
            model = build_model(architecture, self.spec.input_shape, self.spec.num_classes).to(self.device)
            self._modules[architecture] = channels_last_if_faster(model) if self.channels_last else model
        return self._modules[architecture]


M = TypeVar("M")  # a method's modules: what its build_modules() returns


@dataclass
class ClientContext(Generic[M]):
    """Everything a client update may use: its own data, its seeded randomness, the worker's modules."""

    client_id: int
    round: int
    seed: int
    x: torch.Tensor  # uint8 (N, C, H, W) on ``device``; normalised per batch by ``batches``
    y: torch.Tensor  # int64 (N,)
    spec: DataSpec
    fed: FederationConfig
    device: torch.device
    modules: M  # what the method's build_modules() returned, built once per process
    architecture: str = ""  # this client's model architecture (model.client_models, else model.name)
    models: ModelBank | None = None  # one built module per architecture, shared by the worker's clients
    server_x: torch.Tensor | None = None  # the server data's images, for methods whose clients hold them
    pooled: "PooledImages | None" = None  # every client's images: simulation-only diagnostics (wants_pooled_images)
    #: each step's batch a Poisson sample of the client's data (DP-SGD's ``privacy.sample_batches=poisson``)
    poisson_batches: bool = False

    def own_model(self) -> torch.nn.Module:
        """A module of this client's architecture (weights are whatever the last user left: load first)."""
        assert self.models is not None, "the runtime gives every client context a model bank"
        return self.models.get(self.architecture)

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])

    def generator(self, purpose: str = "batches") -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, purpose) % (1 << 63))

    def num_local_steps(self) -> int:
        """``federation.local_steps``, or ``local_epochs`` passes over this client's data when set."""
        return local_step_count(self.fed, self.num_samples)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``num_local_steps()`` mini-batches, reshuffling after each pass (a pass may end on a short batch)."""
        return iter(self.batch_plan())

    def batch_plan(self) -> ClientBatches:
        """The batches of :meth:`batches` as rows of this client's data, drawn up front. The permutations are
        drawn on the CPU from this client's seed, so they are the same on every device. With ``poisson_batches``
        each step's batch is every row with probability min(1, batch_size / n), independently (its size varies)."""
        g = self.generator()
        n, bs = self.num_samples, self.fed.batch_size
        if self.poisson_batches:
            q = min(1.0, bs / max(n, 1))
            index = [torch.nonzero(torch.rand(n, generator=g) < q).flatten() for _ in range(self.num_local_steps())]
            return ClientBatches(self.x, self.y, index, self.spec.mean, self.spec.std)
        perm, pos, index = torch.randperm(n, generator=g), 0, []
        for _ in range(self.num_local_steps()):
            if pos >= n:
                perm, pos = torch.randperm(n, generator=g), 0
            index.append(perm[pos : pos + bs])
            pos += bs
        return ClientBatches(self.x, self.y, index, self.spec.mean, self.spec.std)


@dataclass
class PooledImages:
    """Every client's training images, for a simulation-only diagnostic that breaks privacy (no method may read
    them): draws from the mixture p = (1/K) sum_k p_k of the K clients' distributions, a client uniformly, then one
    of its images uniformly."""

    images: Any  # uint8 (N, C, H, W), numpy (the worker's shared copy of the training split)
    clients: list[Any]  # each client's row indices into ``images``

    def draw(self, n: int, rng: torch.Generator) -> torch.Tensor:
        """``n`` images (uint8, on the CPU) drawn from p with ``rng``."""
        who = torch.randint(len(self.clients), (n,), generator=rng).tolist()
        rows = [self.clients[k][int(torch.randint(len(self.clients[k]), (1,), generator=rng))] for k in who]
        return torch.from_numpy(np.array(self.images[np.array(rows, dtype=np.int64)]))


def local_step_count(fed: FederationConfig, num_samples: int) -> int:
    """A client's optimizer steps per round: ``local_steps``, or ``local_epochs`` passes over its data."""
    if fed.local_epochs is not None:
        return fed.local_epochs * max(1, -(-num_samples // fed.batch_size))
    return fed.local_steps


def batch_plan_rows(num_samples: int, batch_size: int, steps: int) -> int:
    """The rows of ``steps`` mini-batches as :meth:`ClientContext.batch_plan` draws them: passes over the
    ``num_samples`` rows in batches of ``batch_size``, each pass ending on a short batch."""
    per_pass = max(1, -(-num_samples // batch_size))
    full, rest = divmod(steps, per_pass)
    return full * num_samples + min(rest * batch_size, num_samples)


@dataclass
class ServerContext(Generic[M]):
    round: int
    seed: int
    device: torch.device
    modules: M  # the server instance's build_modules()
    # replay loops of fixed-shape steps as CUDA graphs where the device allows (``runtime.cuda_graphs``;
    # :class:`fedray.learning.cuda_graphs.GraphedStep`)
    cuda_graphs: bool = False
    # the one aggregation hook: every mean over the clients' uploads goes through it (:mod:`.aggregation`)
    aggregation: Aggregation = field(default_factory=WeightedMean)


@dataclass
class ClientResult:
    upload: Upload  # sent to the server; counted in comm/bytes_up
    state: ClientState | None  # stays client-side; None for stateless methods
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. train/loss, averaged over clients


