"""The in-process runtime: the same worker and server code as on Ray, called directly."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

import torch

from fedray.methods import Experiment, resolve_experiment
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.runtime.base import Runtime, RuntimeState, local_device
from fedray.learning.store import as_dict, client_states
from fedray.runtime.core import ClientWorkerCore
from fedray.runtime.server_core import ServerCore
from fedray.runtime.process import claim_process, torch_threads
from fedray.system.protocol import Step
from fedray.runtime.personal import client_table, personal_evaluation, personal_models
from fedray.vectorized.policy import describe_vectorised


class LocalRuntime(Runtime):
    def __init__(self, experiment: Experiment | ExperimentConfig, data: FederatedData | None = None):
        self.experiment = resolve_experiment(experiment)
        self.cfg = cfg = self.experiment.cfg
        self.device = local_device(cfg)
        self._give_back = claim_process(cfg)
        self.threads = torch_threads(cfg)
        # private client state, never shown to the server; each client's channel state (stages that keep one per
        # client); beyond runtime.client_state_memory of each, on disk
        self.client_states: MutableMapping[int, Any] = client_states(cfg)
        self.channel_states: MutableMapping[int, Any] = client_states(cfg, purpose="channel")
        self._work: dict[int, tuple] = {}  # each started client's (version, (upload as sent, state, info, wire))
        self.personalised = self.experiment.method.personalised
        if data is not None:
            self.attach(data)

    def attach(self, data: FederatedData) -> None:
        self.server = ServerCore(self.experiment, data, self.device)
        self.worker = ClientWorkerCore(self.experiment, data, self.device)

    # --- the round protocol: the work runs at once, in this process; results wait in _work until taken ----------
    def start(self, round_: int, client_ids: list[int], version: int) -> list[int]:
        payload, nbytes = self.server.payload(version)
        done = self.worker.train_many(round_, client_ids, payload, [self.client_states.get(c) for c in client_ids],
                                      [self.channel_states.get(c) for c in client_ids])
        for cid, work in zip(client_ids, done):
            self._work[cid] = (version, work)
        return [nbytes] * len(client_ids)

    def results(self, client_ids: list[int]) -> list[dict | None]:
        return [self._work[c][1][2] for c in client_ids]

    def drop(self, client_ids: list[int]) -> None:
        for cid in client_ids:
            del self._work[cid]

    def step(self, round_: int, client_ids: list[int], versions: list[int], weights: list[float] | None) -> Step:
        done = [self._work.pop(c)[1] for c in client_ids]
        for cid, (_, state, _, wire) in zip(client_ids, done):
            if state is not None:
                self.client_states[cid] = state
            if wire is not None:
                self.channel_states[cid] = wire
        live = sorted({version for version, _ in self._work.values()})
        t0 = time.perf_counter()
        metrics = self.server.step(round_, [d[0] for d in done], client_ids, versions, weights, live)
        return Step([d[2] for d in done], metrics, time.perf_counter() - t0)

    def evaluate(self) -> dict[str, float]:
        if self.personalised:
            cids = [int(c) for c in self.worker.data.evaluated_clients()]  # every client, or the run's sample
            rows = self.worker.evaluate_clients(cids, [self.client_states.get(c) for c in cids])
            self._client_rows = client_table(self.worker.cfg, rows, cids)
            metrics, self._client_scores = personal_evaluation(rows, self.cfg.adversary.attack == "backdoor", cids)
            return metrics
        metrics, self._client_scores = self.server.evaluation()
        return metrics

    def global_weights(self):
        if self.personalised:
            return personal_models(self.worker.algo, as_dict(self.client_states))  # a store read once, in place
        return self.server.global_weights()

    def export_state(self) -> RuntimeState:
        server, sent, wire = self.server.export_state()
        return RuntimeState(server, as_dict(self.client_states), as_dict(self.channel_states), sent, wire)

    def import_state(self, state: RuntimeState) -> None:
        self.server.import_state(state.server, state.sent, state.server_channel)
        self.client_states = client_states(self.cfg, state.clients)
        self.channel_states = client_states(self.cfg, state.channel, purpose="channel")

    def describe(self) -> str:
        vec = describe_vectorised(self.worker.vectorize, self.worker.vectorize_min)
        return f"local: in-process on {self.device}, {self.threads} torch thread(s){vec}"

    def close(self) -> None:
        self._give_back()
