"""The Ray runtime: a pool of ``ClientWorker`` actors, and the server in the driver or a ``ServerActor``.

- Where the server runs (:mod:`fedray.runtime.server_host`): in the driver when it reserves no resources
  (``runtime.server_in_driver=auto``), else in a ``ServerActor`` with the CPUs / GPU fraction it reserves.
- Start-up: the actors are created first, from small arguments, and import torch and the method while the
  driver loads and partitions the data; :meth:`RayRuntime.attach` then puts the dataset in the object store
  once and hands the server and every worker that one reference, which each maps read-only (zero-copy
  numpy). Not a constructor argument, so a worker restarts even when that object was lost: the driver
  attaches it again, putting the data anew.
- Each round the server's broadcast is stored once and every task receives the same reference.
- A worker gets its clients of a round as one task (one per client only under ``runtime.client_timeout_s``,
  which is per client), trained one by one or vectorised (``runtime.vectorize``). A task returns each
  client's (upload, client state, info) as its own object. As a task finishes, its uploads are handed to
  the server by reference (a server actor fetches them from the worker's node at once); client states
  stay in the object store as references owned by the driver; only small infos are fetched.
- The pool is sized by resources, capped by the clients active in a round. When it has one actor per
  registered client, client ``k`` is always served by actor ``k``; otherwise the round's clients are dealt
  to the actors longest-first by estimated cost (forward FLOPs of the client's architecture x its local
  steps), each to the least-loaded actor: with one architecture and equal steps this is client-id order
  round-robin; with heterogeneous models the heavy clients do not pile up on one actor. Which actor
  trains a client never changes its result.
- Failures: the clients of a task whose worker dies (process killed, OOM, node lost) are rerun together
  from the same inputs on a live worker, up to ``runtime.max_client_retries`` times, giving the same result
  as without the failure; then it is dropped from the round with a warning, as are clients exceeding
  ``runtime.client_timeout_s``. Workers restart in place when their node is alive; one that cannot come back
  is removed and the pool shrinks (:mod:`fedray.runtime.worker_pool`). Losing a server actor stops the run with
  :class:`~fedray.errors.RunFailure` (resumable from the last checkpoint).
- One round protocol (:class:`fedray.system.protocol.Work`) for every schedule: ``start`` submits the tasks of
  clients starting from one model version (a synchronous round's clients, or FedBuff's dispatch), ``results``
  waits for the ones asked (uploads handed to the server as their task ends), ``drop`` forgets some, ``step``
  aggregates. Clients of different versions can be in flight at once; the server keeps each version's payload
  while a client trains from it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fedray.methods import Experiment, resolve_experiment
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import RunFailure
from fedray.adversary.data import backdoor
from fedray.privacy.audit import membership_rows
from fedray.evaluation import ClientScores, EvalIndex
from fedray.runtime.base import Runtime, RuntimeState
from fedray.runtime.actors import EVAL_CHUNK, WORKER_ERRORS, ClientWorker, actor_spec
from fedray.runtime import tensor_wire
from fedray.runtime.ray_start import start_ray
from fedray.runtime.core import data_spec, experiment_channel
from fedray.runtime.server_core import report_eval
from fedray.runtime.personal import client_table, personal_evaluation, personal_models
from fedray.runtime.placement import client_costs, deal, eval_tasks, plan_pool
from fedray.runtime.server_host import ActorServer, DriverServer, server_in_driver
from fedray.vectorized.policy import describe_vectorised, vectorize_enabled, vectorize_min_clients
from fedray.runtime.worker_pool import WorkerPool
from fedray.system.protocol import Step


log = logging.getLogger("fedray")


@dataclass
class Job:
    """A client's task on a worker: its result's object references, and what the driver learnt of it."""

    client_id: int
    round: int  # the round its context gets
    version: int  # the server version it trains from
    worker: int
    upload: Any
    state: Any
    info: Any
    wire: Any  # its new channel state
    attempt: int
    deadline: float
    batch: tuple[int, ...] = ()  # the clients trained with it in one task (vectorised), itself included
    done: dict | None = None  # its info, once fetched
    receipt: Any = None  # the server's receipt of its upload
    confirmed: bool = False  # the server holds its upload


class RayRuntime(Runtime):
    """Starts Ray and the actors at once; ``attach(data)`` (or ``data`` here) gives them the dataset."""

    def __init__(self, experiment: Experiment | ExperimentConfig, data: FederatedData | None = None,
                 owns_ray: bool | None = None):
        """``owns_ray``: whether this runtime shuts Ray down when it closes, for a Ray its caller started for it
        (:func:`~fedray.runtime.ray_start.start_ray_during`); None: it connects or starts one itself."""
        self.experiment = resolve_experiment(experiment)
        self.cfg = cfg = self.experiment.cfg
        self.owns_ray = start_ray(cfg) if owns_ray is None else owns_ray
        tensor_wire.register()  # the driver's tensors too: a resumed run's server and client states
        self.pool: WorkerPool | None = None
        self.server = None
        try:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            self.pool_size = plan_pool(cfg, ray.cluster_resources(), nodes)
            rt = cfg.runtime
            # Not waited for here: they start (a process each, torch imported) while the driver loads the data.
            spec = actor_spec(self.experiment)
            if server_in_driver(cfg):
                self.server = DriverServer(self.experiment)
            else:
                server_opts: dict[str, Any] = {"num_cpus": rt.server_num_cpus, "num_gpus": rt.server_num_gpus}
                if ray.util.get_current_placement_group() is None:
                    # Beside the driver: a run survives losing any other node, not the one it is driven from.
                    # Pinned when the server needs no resources; a server asking for a GPU may go elsewhere.
                    needs = rt.server_num_cpus > 0 or rt.server_num_gpus > 0
                    server_opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                        ray.get_runtime_context().get_node_id(), soft=needs)
                self.server = ActorServer(spec, server_opts)
            self.pool = WorkerPool(lambda: ClientWorker.options(
                num_cpus=rt.num_cpus_per_worker, num_gpus=rt.num_gpus_per_worker, max_restarts=-1,
                max_task_retries=0).remote(spec), self.pool_size)
        except BaseException:
            self.close()
            raise
        self.personalised = self.experiment.method.personalised
        # The global model is scored on the workers (idle between rounds) unless only the server has a GPU.
        self.spread_eval = not (rt.server_num_gpus > 0 and rt.num_gpus_per_worker == 0)
        # A worker gets its clients of a round as one task: one call and one scheduling decision instead of one
        # per client (on the 2-core overhead workload, 2 workers: 0.36 s a round instead of 0.40 s), and what
        # vectorised clients need (the worker's device decides, as in ClientWorkerCore). Not with a client
        # timeout, which is per client: a straggler would hold back the rest of its task.
        worker_device = torch.device("cuda" if cfg.runtime.num_gpus_per_worker > 0 else "cpu")
        self.vectorised = vectorize_enabled(cfg.runtime.vectorize, worker_device)
        self.batch_clients = self.vectorised or cfg.runtime.client_timeout_s is None
        self.client_states: dict[int, ray.ObjectRef] = {}  # driver-owned refs; never sent to the server
        self.channel_stateful = experiment_channel(self.experiment).stateful
        self.channel_states: dict[int, ray.ObjectRef] = {}  # each client's channel state, as client states
        self._work: dict[int, Job] = {}  # each started client's task, until its step or drop
        self._versions: dict[int, tuple[ray.ObjectRef, Any]] = {}  # payloads by server version, and their bytes
        self._lost = 0  # clients whose work was lost since the last step (health/dropped_clients)
        if data is not None:
            self.attach(data)

    def attach(self, data: FederatedData) -> None:
        """Put the dataset in the object store once and give the server and every worker that reference;
        returns when all of them are ready, so start-up is not billed to round 1."""
        try:
            self.server.attach(self.pool.put(data), data)  # in the driver: built here while the workers import
            self.pool.attach_all()
            self.server_pid, self.server_node = self.server.wait_ready()
        except BaseException:
            self.close()
            raise
        self.num_clients = data.num_clients
        self.algo = self.experiment.build(data_spec(data))  # the driver's copy: reads client states, builds nothing
        self.client_cost = client_costs(self.cfg, data.input_shape, data.num_classes, data.client_sizes())
        self.one_actor_per_client = self.pool_size >= self.num_clients
        self.eval_index = EvalIndex(data, backdoor(self.cfg), membership_rows(self.cfg, data))

    def _deal(self, client_ids: list[int]) -> list[tuple[int, int]]:
        if self.one_actor_per_client:
            return [(c, c) for c in client_ids]
        return deal(client_ids, self.client_cost, len(self.pool.workers))

    # --- the round protocol ----------------------------------------------------------------------------------
    def start(self, round_: int, client_ids: list[int], version: int) -> list[int]:
        # Suspect workers are revived or dropped only while no task is out: a shrinking pool renumbers its workers,
        # and the jobs in flight (FedBuff's) name theirs by number
        if not self._work and self.pool.check():
            self.one_actor_per_client = False
        if version not in self._versions:
            self._versions[version] = self.server.payload(version)
        payload_ref, nbytes = self._versions[version]
        # The tasks go out before the payload's size is known: they start when the payload is ready.
        begin, queued = time.monotonic(), [0] * len(self.pool.workers)
        if self.batch_clients:
            per_worker: dict[int, list[int]] = {}
            for cid, w in self._deal(client_ids):
                per_worker.setdefault(w, []).append(cid)
            for w, cids in per_worker.items():
                for job in self._submit_batch(round_, version, sorted(cids), payload_ref, w, begin):
                    self._work[job.client_id] = job
        else:
            for cid, w in self._deal(client_ids):
                self._work[cid] = self._submit(round_, version, cid, payload_ref, w, 0, queued[w], begin)
                queued[w] += 1
        nbytes = self.server.nbytes(nbytes, round_)
        self._versions[version] = (payload_ref, nbytes)
        return [nbytes] * len(client_ids)

    def results(self, client_ids: list[int]) -> list[dict | None]:
        """The infos of ``client_ids``' tasks, waited for in the order they finish; a task's uploads go to the
        server as it ends (an actor fetches them from the worker's node at once). A task whose worker fails is
        rerun from the same inputs (:meth:`_retry_or_drop`); a client past ``runtime.client_timeout_s`` or out of
        retries, or whose upload died with its node, is None."""
        while pending := [j for c in client_ids if (j := self._work.get(c)) is not None and j.done is None]:
            by_ref = {job.info: job for job in pending}
            wait_s = max(0.0, min(j.deadline for j in pending) - time.monotonic())
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=None if math.isinf(wait_s) else wait_s)
            if not ready:
                for job in [j for j in pending if j.deadline <= time.monotonic()]:
                    log.warning("round %d: dropped client %d: not done within runtime.client_timeout_s=%gs",
                                job.round, job.client_id, self.cfg.runtime.client_timeout_s)
                    self._lose(job.client_id)
                    ray.kill(self.pool.workers[job.worker], no_restart=False)  # stop the straggler; it restarts
                    self.pool.suspect.add(job.worker)
                continue
            job = by_ref[ready[0]]
            # The clients of its task finished with it (one task, one outcome): handled together
            task = [j for j in self._work.values() if j is job or (job.batch and j.batch == job.batch and j.done is None
                                                                    and j.attempt == job.attempt
                                                                    and j.worker == job.worker)]
            try:
                infos = ray.get([j.info for j in task])
                receipt = self.server.receive([j.client_id for j in task], [j.upload for j in task])
            except WORKER_ERRORS as e:
                self._retry_or_drop(job, e)
                continue
            for j, info in zip(task, infos):
                j.done, j.receipt = info, receipt
        out: list[dict | None] = []
        for cid in client_ids:
            job = self._work.get(cid)
            if job is not None and not job.confirmed:
                job.confirmed = self.server.confirm(job.receipt, cid, job.round)
                if not job.confirmed:  # the upload died with its node before the server fetched it
                    log.warning("round %d: dropped client %d: its upload was lost with its node", job.round, cid)
                    self._lose(cid)
                    job = None
            out.append(job.done if job is not None else None)
        return out

    def drop(self, client_ids: list[int]) -> None:
        for cid in client_ids:
            self._work.pop(cid, None)

    def step(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float] | None) -> Step:
        jobs = [self._work.pop(c) for c in client_ids]
        live = sorted({j.version for j in self._work.values()})
        keep = sorted(c for c, j in self._work.items() if j.receipt is not None)  # uploads a later step takes
        t0 = time.perf_counter()
        metrics = self.server.step(round_, client_ids, versions, weights, live, keep)
        server_s = time.perf_counter() - t0
        for job in jobs:
            if job.done.get("has_state", True):
                self.client_states[job.client_id] = job.state
            if self.channel_stateful:
                self.channel_states[job.client_id] = job.wire
        metrics["health/dropped_clients"] = float(self._lost)
        self._lost = 0
        self._versions = {v: x for v, x in self._versions.items() if v in set(live)}
        return Step([j.done for j in jobs], metrics, server_s)

    def _lose(self, client_id: int) -> None:
        del self._work[client_id]
        self._lost += 1

    def _submit_batch(self, round_: int, version: int, cids: list[int], payload_ref, worker: int, start: float,
                      attempt: int = 0) -> list[Job]:
        """One task training ``cids`` on ``worker`` (vectorised when ``runtime.vectorize`` says so): a job per
        client, all due when the last would be. A failure reruns the batch as a whole, so its clients get the
        numbers they would have had (a vectorised client's float rounding may depend on its batch-mates)."""
        if len(cids) == 1:
            return [self._submit(round_, version, cids[0], payload_ref, worker, attempt, 0, start)]
        timeout = self.cfg.runtime.client_timeout_s
        k = len(cids)
        refs = self.pool.workers[worker].train_many.options(num_returns=4 * k).remote(
            round_, cids, payload_ref, *[self.client_states.get(c) for c in cids],
            *[self.channel_states.get(c) for c in cids])
        deadline = start + timeout * k if timeout else math.inf
        return [Job(c, round_, version, worker, refs[i], refs[k + i], refs[2 * k + i], refs[3 * k + i], attempt,
                    deadline, tuple(cids)) for i, c in enumerate(cids)]

    def _submit(self, round_: int, version: int, cid: int, payload_ref, worker: int, attempt: int, queue_pos: int,
                start: float) -> Job:
        timeout = self.cfg.runtime.client_timeout_s
        if self.batch_clients:  # a client alone (a rerun, or one per worker) takes the same path as a batch
            up, st, info, wire = self.pool.workers[worker].train_many.options(num_returns=4).remote(
                round_, [cid], payload_ref, self.client_states.get(cid), self.channel_states.get(cid))
        else:
            up, st, info, wire = self.pool.workers[worker].train.options(num_returns=4).remote(
                round_, cid, payload_ref, self.client_states.get(cid), self.channel_states.get(cid))
        deadline = start + timeout * (queue_pos + 1) if timeout else math.inf
        return Job(cid, round_, version, worker, up, st, info, wire, attempt, deadline)

    def _retry_or_drop(self, job: Job, error: BaseException) -> None:
        """Rerun a client whose worker failed on a live worker, with the clients of its task (they failed with
        it: their pending jobs are replaced), or drop them after ``runtime.max_client_retries``."""
        round_ = job.round
        self.pool.suspect.add(job.worker)
        mates = [c for c, j in self._work.items() if c != job.client_id and job.batch and j.batch == job.batch
                 and j.attempt == job.attempt and j.done is None]
        cids = sorted([job.client_id, *mates])
        names = (f"client {cids[0]}" if len(cids) == 1 else "clients " + ", ".join(map(str, cids)))
        them = "it" if len(cids) == 1 else "them together"
        if job.attempt >= self.cfg.runtime.max_client_retries:
            log.warning("round %d: dropped %s after %d attempt(s) (%s)", round_, names, job.attempt + 1,
                        type(error).__name__)
            for c in cids:
                self._lose(c)
            return
        live = [i for i in range(len(self.pool.workers)) if i not in self.pool.suspect]
        if live:
            worker = live[(job.client_id + job.attempt) % len(live)]
        else:  # every worker failed this round: wait for this one to restart rather than burn the retries
            worker = job.worker if job.worker < len(self.pool.workers) else 0  # the pool may have shrunk since
            if self.pool.revive(self.pool.workers[worker]) is None:
                log.warning("round %d: dropped %s: no worker came back to rerun %s", round_, names, them.split()[0])
                for c in cids:
                    self._lose(c)
                return
        log.warning("round %d: %s lost %s worker (%s); rerunning %s on worker %d", round_, names,
                    "its" if len(cids) == 1 else "their", type(error).__name__, them, worker)
        payload_ref = self._versions[job.version][0]
        for new in self._submit_batch(round_, job.version, cids, payload_ref, worker, time.monotonic(),
                                      job.attempt + 1):
            self._work[new.client_id] = new

    def evaluate(self) -> dict[str, float]:
        if self.personalised:
            cids = [int(c) for c in self.eval_index.clients]  # every client, or the run's sample
            rows = self._evaluate_clients(cids)
            self._client_rows = client_table(self.cfg, rows, cids)
            metrics, self._client_scores = personal_evaluation(rows, self.cfg.adversary.attack == "backdoor", cids)
        elif not self.spread_eval:
            metrics, self._client_scores = self.server.call("evaluation")
        else:
            metrics, self._client_scores = self._evaluate_global()
        return metrics

    def _evaluate_global(self) -> tuple[dict[str, float], ClientScores]:
        """The global model scored on the client workers, which sit idle between rounds: the server sends the
        models once (one object), worker k of n scores every n-th fixed batch of the evaluation set (global
        test set, then the clients' test splits), the driver turns the per-sample results into ``eval/*``
        and the global model's per-client figures. The same batches as in-process, so the same figures."""
        models_ref, report = self.server.eval_models()
        parts = self.pool.run_on_all(lambda workers: [w.evaluate_global.remote(models_ref, k, len(workers))
                                                      for k, w in enumerate(workers)], "evaluation")
        scored, clients = self.eval_index.merged(parts)
        return report_eval(scored, report), clients

    def _evaluate_clients(self, client_ids: list[int]) -> list[tuple]:
        """Every client's own model scored on the workers, in tasks of at most EVAL_CHUNK clients (a task
        deserialises the states it is given: small tasks keep that to a few models per worker), as many
        tasks per worker, of sizes differing by at most one client (each client costs about the same: the
        global test set dominates), dealt round-robin."""
        def submit(workers):
            return [workers[k % len(workers)].evaluate_clients.remote(chunk, *[self.client_states.get(c) for c in chunk])
                    for k, chunk in enumerate(eval_tasks(client_ids, len(workers), EVAL_CHUNK))]
        return [row for part in self.pool.run_on_all(submit, "evaluation") for row in part]

    def global_weights(self):
        if self.personalised:
            cids = sorted(self.client_states)
            return personal_models(self.algo, dict(zip(cids, ray.get([self.client_states[c] for c in cids]))))
        return self.server.call("global_weights")

    def export_state(self) -> RuntimeState:
        def fetched(refs: dict[int, ray.ObjectRef]) -> dict[int, Any]:
            cids = sorted(refs)
            return dict(zip(cids, ray.get([refs[c] for c in cids])))

        server, sent, wire = self.server.call("export_state")
        return RuntimeState(server, fetched(self.client_states), fetched(self.channel_states), sent, wire)

    def import_state(self, state: RuntimeState) -> None:
        self.server.call("import_state", state.server, state.sent, state.server_channel)
        self.client_states = {cid: ray.put(st) for cid, st in state.clients.items()}
        self.channel_states = {cid: ray.put(st) for cid, st in state.channel.items()}
        self._versions = {}

    def describe(self) -> str:
        rt = self.cfg.runtime
        server = ("server in the driver" if self.server.in_driver
                  else f"server {rt.server_num_cpus:g} CPU / {rt.server_num_gpus:g} GPU")
        return (f"ray: {self.pool_size} client worker(s) x {rt.num_cpus_per_worker:g} CPU / "
                f"{rt.num_gpus_per_worker:g} GPU, {server}"
                + describe_vectorised(self.vectorised, vectorize_min_clients(rt)))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.kill()
        if self.server is not None:
            self.server.close()
        self.server = None
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False
