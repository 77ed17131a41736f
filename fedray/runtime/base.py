"""What the round loop needs from a runtime; where the work runs is the runtime's business."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import ResourceError
from fedray.evaluation import ClientScores


#: The simulated system's say on a round's uploads (:meth:`fedray.system.SystemClock.admit` behind it): given the
#: clients that finished, in client-id order, their infos and the broadcast's size, the ids whose uploads arrive.
Admit = Callable[[list[int], list[dict], int], list[int]]


@dataclass
class RoundOutcome:
    client_infos: list[dict]  # one per client, in client-id order
    server_metrics: dict[str, float]
    payload_bytes: int  # size of the broadcast sent to each sampled client
    server_s: float = 0.0  # wall time of the server's aggregation (the method's server update), as the runtime waited


class Runtime(ABC):
    #: Personalised methods: each client's figures at the last evaluation (set by ``evaluate``).
    _client_rows: list[dict] | None = None
    #: Every method: the evaluated clients' figures at the last evaluation (set by ``evaluate``).
    _client_scores: ClientScores | None = None

    @abstractmethod
    def attach(self, data: FederatedData) -> None:
        """Give the runtime its dataset (once, before the first round). Separate from construction so that
        a runtime with processes to start (Ray) starts them while the caller loads the data."""

    @abstractmethod
    def run_round(self, round_: int, client_ids: list[int], admit: Admit | None = None) -> RoundOutcome:
        """Broadcast, train ``client_ids`` (sorted), aggregate their uploads on the server. With ``admit`` only the
        uploads it lets through reach the server (none: the server state stays as it was), and only those clients
        keep their new state; ``client_infos`` are theirs."""

    # --- federation.mode=async (the driver's schedule orders the events; these run the work) ----------------------
    def submit(self, round_: int, client_id: int, version: int) -> int:
        """Start ``client_id``'s training from the payload of the model after ``version`` server steps (``round_``:
        the round its context gets, version + 1); returns that payload's bytes. One task per client at a time."""
        raise NotImplementedError(f"{type(self).__name__} does not run federation.mode=async")

    def finished(self, client_id: int) -> dict:
        """The info of ``client_id``'s submitted training (waits for it)."""
        raise NotImplementedError

    def discard(self, client_id: int) -> None:
        """Forget ``client_id``'s submitted training (a dropout): its upload and new state are lost."""
        raise NotImplementedError

    def apply(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float],
              live: list[int]) -> tuple[list[dict], dict[str, float]]:
        """One asynchronous server step on the finished uploads of ``client_ids`` (client-id order), trained from
        ``versions`` and weighted by ``weights`` (:meth:`ServerCore.aggregate_stale`); those clients keep their new
        state. ``live``: the versions clients still train from. Returns (their infos, server metrics)."""
        raise NotImplementedError

    def sent_payloads(self) -> dict:
        """Async: the payloads clients still train from, by version (for a checkpoint)."""
        return {}

    def load_sent_payloads(self, sent: dict) -> None:
        """Continue from a checkpoint's :meth:`sent_payloads`."""

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
    def export_state(self) -> tuple[Any, dict[int, Any]]:
        """(server state, {client id: private state}) for a checkpoint, as plain objects."""

    @abstractmethod
    def import_state(self, server_state: Any, client_states: dict[int, Any]) -> None:
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
