"""The Ray actors of the Ray runtime.

``ClientWorker`` wraps :class:`~fedray.runtime.core.ClientWorkerCore` and ``ServerActor`` wraps
:class:`~fedray.runtime.server_core.ServerCore`: the same code the in-process runtime calls directly. Both are built
from small arguments and given the dataset afterwards by ``attach`` (see :mod:`fedray.runtime.ray_runtime`).

This module imports neither torch nor the rest of fedray at its top, and the actors' methods name nothing
that does: Ray ships an actor's class by value, with the modules its methods use, so a worker process would
import them (and pydantic and the method, for the constructor's arguments) before ``__init__`` runs. They
load in ``__init__`` instead, from :func:`actor_spec`'s bytes, with the garbage collector paused
(:func:`fedray.gc_pause.imports_without_gc`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from fedray.gc_pause import imports_without_gc

if TYPE_CHECKING:
    import torch

    from fedray.data.federated import FederatedData
    from fedray.methods import Experiment
    from fedray.runtime.core import ClientWorkerCore
    from fedray.runtime.server_core import ServerCore


class WorkerNotAttached(RuntimeError):
    """A client worker that restarted has not been given the dataset again (see ``ClientWorker.attach``)."""


# Failures of the machinery, not of the method: the client's task is rerun. An exception raised by the
# method's own code (RayTaskError) is a bug and propagates.
SYSTEM_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                 ray.exceptions.ObjectLostError, ray.exceptions.OutOfMemoryError)
# ... and of a client worker's task: also a restarted worker that has no dataset yet (attached next round).
WORKER_ERRORS = (*SYSTEM_ERRORS, WorkerNotAttached)
EVAL_CHUNK = 16  # clients per personalised-evaluation task
READY_TIMEOUT_S = 60.0  # a restarting worker imports torch and maps the dataset: seconds, more on a busy node


def actor_spec(experiment: Experiment) -> bytes:
    """What a ``ClientWorker`` or ``ServerActor`` is built from: the resolved experiment (config, the method's
    class, its parameters), pickled by the driver as Ray would pickle it, and unpickled by :func:`_start_actor`."""
    return ray.cloudpickle.dumps(experiment)


def _start_actor(spec: bytes) -> Experiment:
    """The actor process's start: its imports (with the collector paused), threads, malloc settings and how
    its tensors go into the object store (:mod:`fedray.runtime.tensor_wire`)."""
    with imports_without_gc():
        experiment = ray.cloudpickle.loads(spec)  # imports pydantic, torch and the method
        from fedray.runtime import core, tensor_wire  # noqa: F401 (the round's code, loaded now, not by the first task)
        from fedray.runtime.process import claim_process
    claim_process(experiment.cfg)
    tensor_wire.register()
    return experiment


def _actor_device() -> torch.device:
    import torch

    # A CPU-only actor still sees every GPU of its node; only the GPUs Ray assigned are ours.
    return torch.device("cuda") if ray.get_gpu_ids() else torch.device("cpu")


@ray.remote
class ClientWorker:
    """Trains and evaluates clients. Built from small arguments only and given the dataset afterwards by
    ``attach``: a restartable actor whose constructor arguments live in the object store cannot restart
    once that object is lost (ray-project/ray#53727), so after a restart the driver attaches it again,
    re-putting the dataset if its object is gone."""

    def __init__(self, spec: bytes):
        self.experiment = _start_actor(spec)
        self.cfg = self.experiment.cfg
        self.core: ClientWorkerCore | None = None

    def ready(self) -> tuple[int, str, bool]:
        return os.getpid(), ray.get_runtime_context().get_node_id(), self.core is not None

    def attach(self, data: FederatedData) -> tuple[int, str, bool]:
        if self.core is None:
            from fedray.runtime.core import ClientWorkerCore

            self.core = ClientWorkerCore(self.experiment, data, _actor_device())
        return self.ready()

    def _core(self) -> ClientWorkerCore:
        if self.core is None:
            raise WorkerNotAttached("restarted without its dataset")
        return self.core

    def train(self, round_: int, client_id: int, payload: Any, state: Any, wire: Any):
        return self._core().train(round_, client_id, payload, state, wire)

    def train_many(self, round_: int, client_ids: list[int], payload: Any, *states: Any) -> list:
        """Several clients in one task (vectorised on the worker); ``states``: the clients' states, then their
        channel states. Returns uploads, then states, then infos, then channel states, flat, so each is its own
        object reference and the rest of the round handles them client by client."""
        k = len(client_ids)
        done = self._core().train_many(round_, client_ids, payload, list(states[:k]), list(states[k:]))
        return [part[i] for i in range(4) for part in done]

    def evaluate_clients(self, client_ids: list[int], *states: Any):
        # States arrive as top-level arguments so Ray resolves their references before the call.
        return self._core().evaluate_clients(client_ids, list(states))

    def evaluate_global(self, models: dict, part: int, parts: int):
        return self._core().evaluate_global(models, part, parts)


@ray.remote
class ServerActor:
    """Started from small arguments, like the workers, and given the dataset by ``attach``."""

    def __init__(self, spec: bytes):
        self.experiment = _start_actor(spec)
        self.cfg = self.experiment.cfg
        self.core: ServerCore | None = None
        self.inbox: dict[int, Any] = {}

    def attach(self, data: FederatedData) -> tuple[int, str]:
        if self.core is None:
            from fedray.runtime.server_core import ServerCore

            self.core = ServerCore(self.experiment, data, _actor_device())
        return self.ready()

    def ready(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def payload(self, version: int):
        return self.core.payload(version)

    def receive(self, client_ids: list[int], *uploads: Any) -> None:
        # Uploads arrive as top-level arguments: resolving them pulled them to this node.
        self.inbox.update(zip(client_ids, uploads))

    def step(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float] | None,
             live: list[int], keep: list[int]) -> dict[str, float]:
        """The server step over the uploads of ``client_ids``; of the rest of the inbox only ``keep`` stays (clients
        still training: their uploads wait for a later step; the others were dropped)."""
        uploads = [self.inbox.pop(c) for c in client_ids]
        self.inbox = {c: u for c, u in self.inbox.items() if c in set(keep)}
        return self.core.step(round_, uploads, client_ids, versions, weights, live)

    def evaluation(self):
        return self.core.evaluation()

    def eval_models(self):
        return self.core.eval_models()

    def global_weights(self):
        return self.core.global_weights()

    def export_state(self):
        return self.core.export_state()

    def import_state(self, state, sent, wire) -> None:
        self.core.import_state(state, sent, wire)
