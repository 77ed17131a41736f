"""What the round loop needs from a runtime; where the work runs is the runtime's business."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import ResourceError
from fedray.evaluation import ClientScores
from fedray.system.protocol import Step
from fedray.system.rounds import fresh_round


@dataclass
class RoundOutcome:
    """A synchronous round run by :meth:`Runtime.run_round` (scripts and tests)."""

    client_infos: list[dict]  # one per client, in client-id order
    server_metrics: dict[str, float]
    payload_bytes: int  # size of the payload sent to each client, after the channel
    server_s: float = 0.0  # wall time of the server step, as the runtime waited


@dataclass
class RuntimeState:
    """What a checkpoint keeps of a runtime: the server state, each client's private state and channel state, the
    payloads clients still train from (by server version; asynchronous schedules only) and the channel's server
    state (downlink error feedback)."""

    server: Any
    clients: dict[int, Any]
    channel: dict[int, Any] = field(default_factory=dict)
    sent: dict[int, Any] = field(default_factory=dict)
    server_channel: Any = None


class Runtime(ABC):
    """Where the work runs. It implements the one round protocol (:class:`fedray.system.protocol.Work`:
    :meth:`start`, :meth:`results`, :meth:`drop`, :meth:`step`) that every schedule drives, synchronous or not;
    the rest evaluates, checkpoints and describes."""

    #: Personalised methods: each client's figures at the last evaluation (set by ``evaluate``).
    _client_rows: list[dict] | None = None
    #: Every method: the evaluated clients' figures at the last evaluation (set by ``evaluate``).
    _client_scores: ClientScores | None = None

    @abstractmethod
    def attach(self, data: FederatedData) -> None:
        """Give the runtime its dataset (once, before the first round). Separate from construction so that
        a runtime with processes to start (Ray) starts them while the caller loads the data."""

    # --- the round protocol (fedray.system.protocol.Work) ------------------------------------------------------
    @abstractmethod
    def start(self, round_: int, client_ids: list[int], version: int) -> list[int]:
        """Start ``client_ids``' training from the payload of the model after ``version`` server steps; returns the
        bytes sent to each. One piece of work per client at a time."""

    @abstractmethod
    def results(self, client_ids: list[int]) -> list[dict | None]:
        """Each started client's info (waits); None where its work was lost."""

    @abstractmethod
    def drop(self, client_ids: list[int]) -> None:
        """Forget the started work of ``client_ids``: uploads and new states lost."""

    @abstractmethod
    def step(self, round_: int, client_ids: list[int], versions: list[int],
             weights: list[float] | None) -> Step:
        """One server step over the uploads of ``client_ids`` (their work started, results taken); those clients
        keep their new states. See :meth:`fedray.system.protocol.Work.step`."""

    def run_round(self, round_: int, client_ids: list[int]) -> RoundOutcome:
        """A synchronous round of ``client_ids`` (sorted) through the protocol, every upload arriving: for scripts
        and tests (a run's rounds come from its schedule)."""
        step, down = fresh_round(self, round_, client_ids)
        return RoundOutcome(step.infos, step.metrics, down[0] if down else 0, step.wall_s)

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """``eval/*`` metrics of the current global model (personalised methods: of every client's own)."""

    @abstractmethod
    def global_weights(self) -> dict:
        """The current global model (CPU tensors), e.g. to save it; for personalised methods
        ``{client id: weights}`` of every client that has trained."""

    def client_evaluation(self) -> list[dict] | None:
        """Personalised methods: each client's figures at the last evaluation (client, architecture,
        own-test-split and global-test accuracy); None otherwise or before any evaluation."""
        return self._client_rows

    def client_scores(self) -> ClientScores | None:
        """The last evaluation's figures per evaluated client (those with a local test split): the global
        model's, or for personalised methods each client's own model's (``clients.parquet``'s rows); None
        before any evaluation."""
        return self._client_scores

    @abstractmethod
    def export_state(self) -> RuntimeState:
        """What a checkpoint keeps, as plain objects."""

    @abstractmethod
    def import_state(self, state: RuntimeState) -> None:
        """Continue from a checkpoint's states."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the console: where the work runs."""

    def close(self) -> None:
        """Release processes and resources; safe to call twice."""

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def local_device(cfg: ExperimentConfig) -> torch.device:
    """The device of the in-process runtime: ``runtime.device`` (auto = CUDA when there is one)."""
    want = cfg.runtime.device
    has_cuda = torch.cuda.is_available()
    if want == "cuda" or cfg.runtime.num_gpus_per_worker > 0:
        if not has_cuda:
            key = "runtime.device" if want == "cuda" else "runtime.num_gpus_per_worker"
            raise ResourceError(key, "asks for a GPU but none is visible here; use runtime.device=cpu and "
                                "runtime.num_gpus_per_worker=0, or run on a GPU machine")
        return torch.device("cuda")
    return torch.device("cuda" if want == "auto" and has_cuda else "cpu")
