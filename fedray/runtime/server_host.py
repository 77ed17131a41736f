"""Where the Ray runtime's server runs: a ``ServerActor`` of its own, or the driver's process.

Both hold the same :class:`~fedray.runtime.server_core.ServerCore` (the in-process runtime's), so a run's figures do
not depend on the choice (``runtime.server_in_driver``; ``tests/runtime/test_runtimes.py`` checks).

- :class:`ActorServer`: a ``ServerActor`` with the resources ``runtime.server_num_cpus`` / ``server_num_gpus``
  reserve (a GPU fraction on a cluster). Uploads go from the workers to it by reference.
- :class:`DriverServer`: the server in the driver, when it reserves nothing (``auto``). Such an actor is pinned
  to the driver's node anyway, so uploads take the same path (that node's object store); what goes is a
  process importing torch and the method at start-up (round 1 about a second sooner on the 2-core overhead
  workload, ``benchmarks/README.md``) and ~100 MB. Such a server cannot be lost on its own: it goes only
  with the driver.

The methods raise :class:`~fedray.errors.RunFailure` where the server is lost, the round named.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import RunFailure
from fedray.runtime.actors import SYSTEM_ERRORS, ServerActor

if TYPE_CHECKING:
    from fedray.methods import Experiment


def server_in_driver(cfg: ExperimentConfig) -> bool:
    """``runtime.server_in_driver``; ``auto``: in the driver when the server reserves no resources and the
    driver is not a Ray Client (``ray://``), whose process sits outside the cluster."""
    rt = cfg.runtime
    if rt.server_in_driver != "auto":
        return rt.server_in_driver
    address = rt.address or os.environ.get("RAY_ADDRESS") or ""
    return rt.server_num_cpus == 0 and rt.server_num_gpus == 0 and not address.startswith("ray://")


def _lost(where: str, error: BaseException) -> RunFailure:
    return RunFailure(f"{where}the server actor was lost ({type(error).__name__})")


class ActorServer:
    """The server in a ``ServerActor`` started from ``spec`` (:func:`~fedray.runtime.actors.actor_spec`)."""

    in_driver = False

    def __init__(self, spec: bytes, options: dict[str, Any]):
        self.actor = ServerActor.options(**options).remote(spec)
        self._ready = None

    def attach(self, data_ref: ray.ObjectRef, data: FederatedData) -> None:
        """Starts giving it the dataset; :meth:`wait_ready` waits for that."""
        self._ready = self.actor.attach.remote(data_ref)

    def wait_ready(self) -> tuple[int, str]:
        return ray.get(self._ready)  # (pid, node id)

    def payload(self, version: int) -> tuple[ray.ObjectRef, Any]:
        """The payload of server version ``version`` (a reference, for the workers) and its bytes, to be fetched
        with :meth:`nbytes` once the clients' tasks are out (they start when the payload is ready)."""
        payload_ref, nbytes_ref = self.actor.payload.options(num_returns=2).remote(version)
        return payload_ref, nbytes_ref

    def nbytes(self, nbytes: Any, round_: int) -> int:
        """The bytes :meth:`payload` gave (a reference, or the number once fetched), for a round's clients."""
        return nbytes if isinstance(nbytes, int) else self._get(nbytes, f"round {round_}: ")

    def receive(self, client_ids: list[int], uploads: list[ray.ObjectRef]) -> ray.ObjectRef:
        # One call: the actor resolves the references as arguments, fetching the uploads from the workers' nodes.
        return self.actor.receive.remote(client_ids, *uploads)

    def confirm(self, receipt: ray.ObjectRef, client_id: int, round_: int) -> bool:
        """True if the server holds the upload; False if it was lost with its node before the server fetched it."""
        try:
            ray.get(receipt)
            return True
        except ray.exceptions.RayActorError as e:
            raise _lost(f"round {round_}: ", e) from None
        except SYSTEM_ERRORS:
            return False

    def step(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float] | None,
             live: list[int], keep: list[int]) -> dict[str, float]:
        """A server step's metrics; its RunFailure (every upload non-finite) as it was raised."""
        try:
            return ray.get(self.actor.step.remote(round_, client_ids, versions, weights, live, keep))
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, RunFailure):
                raise e.cause from None
            raise
        except SYSTEM_ERRORS as e:
            raise _lost(f"round {round_}: ", e) from None

    def eval_models(self) -> tuple[ray.ObjectRef, dict]:
        """The models to score (one object, for the workers) and the server's part of the report."""
        models_ref, report_ref = self.actor.eval_models.options(num_returns=2).remote()
        return models_ref, self._get(report_ref)

    def call(self, method: str, *args: Any) -> Any:
        """``evaluation``, ``global_weights``, ``export_state`` or ``import_state``."""
        return self._get(getattr(self.actor, method).remote(*args))

    def _get(self, ref: ray.ObjectRef, where: str = "") -> Any:
        try:
            return ray.get(ref)
        except SYSTEM_ERRORS as e:
            raise _lost(where, e) from None

    def close(self) -> None:
        ray.kill(self.actor)


class DriverServer:
    """The server in this (the driver's) process, on its CPU, with the threads and memory settings a
    ``ServerActor`` would have; its uploads are fetched here by reference when the round is aggregated."""

    in_driver = True

    def __init__(self, experiment: Experiment):
        from fedray.runtime.process import claim_process

        self.experiment, self.cfg = experiment, experiment.cfg
        cfg = self.cfg
        self.core = None
        self.inbox: dict[int, Any] = {}
        self._give_back = claim_process(cfg)

    def attach(self, data_ref: ray.ObjectRef, data: FederatedData) -> None:
        import torch

        from fedray.runtime.server_core import ServerCore

        if self.core is None:
            self.core = ServerCore(self.experiment, data, torch.device("cpu"))

    def wait_ready(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def payload(self, version: int) -> tuple[ray.ObjectRef, int]:
        payload, nbytes = self.core.payload(version)
        return ray.put(payload), nbytes

    def nbytes(self, nbytes: int, round_: int) -> int:
        return nbytes

    def receive(self, client_ids: list[int], uploads: list[ray.ObjectRef]) -> dict[int, ray.ObjectRef]:
        return dict(zip(client_ids, uploads))

    def confirm(self, receipt: dict[int, ray.ObjectRef], client_id: int, round_: int) -> bool:
        if client_id not in self.inbox:
            # A task's uploads in one call, as an actor gets them (1,000 clients a round: one get per task, not per
            # client); one by one only when one of them was lost, to tell which.
            try:
                self.inbox.update(zip(receipt, ray.get(list(receipt.values()))))
            except SYSTEM_ERRORS:
                try:
                    self.inbox[client_id] = ray.get(receipt[client_id])
                except SYSTEM_ERRORS:  # lost with its node
                    return False
        return True

    def step(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float] | None,
             live: list[int], keep: list[int]) -> dict[str, float]:
        uploads = [self.inbox.pop(c) for c in client_ids]
        self.inbox = {c: u for c, u in self.inbox.items() if c in set(keep)}
        return self.core.step(round_, uploads, client_ids, versions, weights, live)

    def eval_models(self) -> tuple[ray.ObjectRef, dict]:
        models, report = self.core.eval_models()
        return ray.put(models), report

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.core, method)(*args)

    def close(self) -> None:
        import torch

        self.inbox.clear()
        self._give_back()
