"""The Ray runtime: a pool of ``ClientWorker`` actors and a ``ServerActor`` (DESIGN.md, "Shape of a round").

- The dataset is put in the object store once; every actor maps it read-only (zero-copy numpy).
- Each round the server's broadcast is stored once and every client task receives the same reference.
- Client tasks return (upload, client state, info). Uploads go straight from the worker to the server
  actor as task arguments, never through the driver; client states stay in the object store as
  references owned by the driver; only the small infos are fetched.
- The pool is sized by resources, capped by the clients active in a round. When it has one actor per
  registered client, client ``k`` is always served by actor ``k``; otherwise the round's clients are dealt
  to the actors in client-id order.
"""

from __future__ import annotations

import math
import os
from typing import Any

import ray
import torch

from fedray.algorithms import get_algorithm
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import ResourceError
from fedray.runtime.base import RoundOutcome, Runtime
from fedray.runtime.core import ClientWorkerCore, ServerCore, torch_threads


def _actor_device() -> torch.device:
    # A CPU-only actor still sees every GPU of its node; only the GPUs Ray assigned are ours.
    return torch.device("cuda") if ray.get_gpu_ids() else torch.device("cpu")


@ray.remote
class ClientWorker:
    def __init__(self, cfg: ExperimentConfig, data: FederatedData, algo_cls: type):
        torch.set_num_threads(torch_threads(cfg))
        self.core = ClientWorkerCore(cfg, data, _actor_device(), algo_cls)

    def ready(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def train(self, round_: int, client_id: int, payload: Any, state: Any):
        return self.core.train(round_, client_id, payload, state)


@ray.remote
class ServerActor:
    def __init__(self, cfg: ExperimentConfig, data: FederatedData, algo_cls: type):
        torch.set_num_threads(torch_threads(cfg))
        self.core = ServerCore(cfg, data, _actor_device(), algo_cls)

    def ready(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def broadcast(self, round_: int):
        return self.core.broadcast(round_)

    def aggregate(self, round_: int, *uploads: Any) -> dict[str, float]:
        return self.core.aggregate(round_, list(uploads))

    def evaluate(self) -> dict[str, float]:
        return self.core.evaluate()

    def global_weights(self):
        return self.core.global_weights()


def start_ray(cfg: ExperimentConfig) -> bool:
    """Connect to ``runtime.address`` or start a local Ray; True if this call started it."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": "ERROR", "configure_logging": True}
    if cfg.runtime.address is None:
        # A local cluster: no dashboard (nothing listens beyond what Ray needs on 127.0.0.1).
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs.update(include_dashboard=False, num_cpus=os.cpu_count())
    ray.init(address=cfg.runtime.address, **kwargs)
    return True


def plan_pool(cfg: ExperimentConfig, resources: dict[str, float], node_resources: list[dict[str, float]]) -> int:
    """Number of client workers: ``runtime.num_workers`` or what the cluster's CPUs/GPUs allow."""
    rt = cfg.runtime
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if rt.num_gpus_per_worker > 0 and gpus == 0:
        raise ResourceError("runtime.num_gpus_per_worker", f"is {rt.num_gpus_per_worker} but the Ray cluster "
                            "has no GPU; set runtime.num_gpus_per_worker=0 or add GPU nodes")
    if rt.server_num_gpus > gpus:
        raise ResourceError("runtime.server_num_gpus", f"is {rt.server_num_gpus} but the Ray cluster has "
                            f"{gpus:g} GPU(s); allowed: 0..{gpus:g}")
    biggest = max((n.get("CPU", 0.0) for n in node_resources), default=cpus)
    if rt.num_cpus_per_worker > biggest:
        raise ResourceError("runtime.num_cpus_per_worker", f"is {rt.num_cpus_per_worker:g} but the largest "
                            f"node has {biggest:g} CPUs; allowed: at most {biggest:g}")
    capacity = math.floor((cpus - rt.server_num_cpus) / rt.num_cpus_per_worker + 1e-9)
    if rt.num_gpus_per_worker > 0:
        capacity = min(capacity, math.floor((gpus - rt.server_num_gpus) / rt.num_gpus_per_worker + 1e-9))
    if rt.num_workers is not None:
        if rt.num_workers > capacity:
            raise ResourceError("runtime.num_workers", f"{rt.num_workers} workers with "
                                f"{rt.num_cpus_per_worker:g} CPU / {rt.num_gpus_per_worker:g} GPU each do not fit "
                                f"in the cluster ({cpus:g} CPUs, {gpus:g} GPUs); allowed: at most {capacity}, or "
                                "lower runtime.num_cpus_per_worker")
        return rt.num_workers
    if capacity < 1:
        raise ResourceError("runtime.num_cpus_per_worker", f"no client worker fits in the cluster ({cpus:g} CPUs, "
                            f"{gpus:g} GPUs); lower runtime.num_cpus_per_worker / runtime.num_gpus_per_worker")
    return max(1, min(capacity, cfg.federation.clients_per_round))


class RayRuntime(Runtime):
    def __init__(self, cfg: ExperimentConfig, data: FederatedData):
        self.cfg = cfg
        self.owns_ray = start_ray(cfg)
        self.workers: list = []
        self.server = None
        try:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            self.pool_size = plan_pool(cfg, ray.cluster_resources(), nodes)
            rt = cfg.runtime
            data_ref = ray.put(data)
            algo_cls = get_algorithm(cfg.algorithm.name)
            self.server = ServerActor.options(num_cpus=rt.server_num_cpus, num_gpus=rt.server_num_gpus).remote(
                cfg, data_ref, algo_cls
            )
            self.workers = [
                ClientWorker.options(num_cpus=rt.num_cpus_per_worker, num_gpus=rt.num_gpus_per_worker).remote(
                    cfg, data_ref, algo_cls
                )
                for _ in range(self.pool_size)
            ]
            # Wait for every actor so start-up is not billed to round 1.
            ready = ray.get([self.server.ready.remote()] + [w.ready.remote() for w in self.workers])
            self.server_pid, self.server_node = ready[0]
            self.worker_pids = [pid for pid, _ in ready[1:]]
            self.worker_nodes = [node for _, node in ready[1:]]
        except BaseException:
            self.close()
            raise
        self.num_clients = data.num_clients
        self.client_states: dict[int, ray.ObjectRef] = {}  # driver-owned refs; never sent to the server

    def _worker_for(self, position: int, client_id: int):
        if self.pool_size >= self.num_clients:
            return self.workers[client_id]
        return self.workers[position % self.pool_size]

    def run_round(self, round_: int, client_ids: list[int]) -> RoundOutcome:
        payload_ref, bytes_ref = self.server.broadcast.options(num_returns=2).remote(round_)
        uploads, states, infos = [], {}, []
        for pos, cid in enumerate(client_ids):
            worker = self._worker_for(pos, cid)
            up, st, info = worker.train.options(num_returns=3).remote(
                round_, cid, payload_ref, self.client_states.get(cid)
            )
            uploads.append(up)
            states[cid] = st
            infos.append(info)
        metrics_ref = self.server.aggregate.remote(round_, *uploads)
        infos = ray.get(infos)
        metrics = ray.get(metrics_ref)
        for info, (cid, st) in zip(infos, states.items()):
            if info.get("has_state", True):
                self.client_states[cid] = st
        return RoundOutcome(infos, metrics, ray.get(bytes_ref))

    def evaluate(self) -> dict[str, float]:
        return ray.get(self.server.evaluate.remote())

    def global_weights(self):
        return ray.get(self.server.global_weights.remote())

    def describe(self) -> str:
        rt = self.cfg.runtime
        return (f"ray: {self.pool_size} client worker(s) x {rt.num_cpus_per_worker:g} CPU / "
                f"{rt.num_gpus_per_worker:g} GPU, server {rt.server_num_cpus:g} CPU / {rt.server_num_gpus:g} GPU")

    def close(self) -> None:
        for actor in [*self.workers, self.server]:
            if actor is not None:
                ray.kill(actor)
        self.workers, self.server = [], None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False
