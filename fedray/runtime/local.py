"""The in-process runtime: the same worker and server code as on Ray, called directly."""

from __future__ import annotations

import time
from typing import Any

import torch

from fedray.methods import Experiment, resolve_experiment
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.runtime.base import Admit, RoundOutcome, Runtime, local_device
from fedray.runtime.core import ClientWorkerCore, ServerCore
from fedray.runtime.process import claim_process, torch_threads
from fedray.runtime.personal import client_table, personal_evaluation, personal_models
from fedray.vectorized.policy import describe_vectorised


class LocalRuntime(Runtime):
    def __init__(self, experiment: Experiment | ExperimentConfig, data: FederatedData | None = None):
        self.experiment = resolve_experiment(experiment)
        self.cfg = cfg = self.experiment.cfg
        self.device = local_device(cfg)
        self._give_back = claim_process(cfg)
        self.threads = torch_threads(cfg)
        self.client_states: dict[int, Any] = {}  # private client state, never shown to the server
        self._flight: dict[int, tuple] = {}  # async: each training client's (upload, new state, info)
        self.personalised = self.experiment.method.personalised
        if data is not None:
            self.attach(data)

    def attach(self, data: FederatedData) -> None:
        self.server = ServerCore(self.experiment, data, self.device)
        self.worker = ClientWorkerCore(self.experiment, data, self.device)
        self.num_clients = data.num_clients

    def run_round(self, round_: int, client_ids: list[int], admit: Admit | None = None) -> RoundOutcome:
        payload, payload_bytes = self.server.broadcast(round_)
        done = self.worker.train_many(round_, client_ids, payload, [self.client_states.get(c) for c in client_ids])
        kept = set(admit(client_ids, [info for _, _, info in done], payload_bytes)) if admit else set(client_ids)
        uploads, infos, ids = [], [], []
        for cid, (upload, state, info) in zip(client_ids, done):
            if cid not in kept:
                continue
            if state is not None:
                self.client_states[cid] = state
            uploads.append(upload)
            infos.append(info)
            ids.append(cid)
        t0 = time.perf_counter()
        metrics = self.server.aggregate(round_, uploads, ids)
        return RoundOutcome(infos, metrics, payload_bytes, time.perf_counter() - t0)

    def submit(self, round_: int, client_id: int, version: int) -> int:
        payload, payload_bytes = self.server.payload_of(version)
        (done,) = self.worker.train_many(round_, [client_id], payload, [self.client_states.get(client_id)])
        self._flight[client_id] = done
        return payload_bytes

    def finished(self, client_id: int) -> dict:
        return self._flight[client_id][2]

    def discard(self, client_id: int) -> None:
        del self._flight[client_id]

    def apply(self, round_, client_ids, versions, weights, live):
        done = [self._flight.pop(c) for c in client_ids]
        for cid, (_, state, _) in zip(client_ids, done):
            if state is not None:
                self.client_states[cid] = state
        metrics = self.server.aggregate_stale(round_, [d[0] for d in done], client_ids, versions, weights, live)
        return [d[2] for d in done], metrics

    def sent_payloads(self) -> dict:
        return self.server.sent_payloads()

    def load_sent_payloads(self, sent: dict) -> None:
        self.server.load_sent_payloads(sent)

    def evaluate(self) -> dict[str, float]:
        if self.personalised:
            cids = list(range(self.num_clients))
            rows = self.worker.evaluate_clients(cids, [self.client_states.get(c) for c in cids])
            self._client_rows = client_table(self.worker.cfg, rows)
            metrics, self._client_scores = personal_evaluation(rows)
            return metrics
        metrics, self._client_scores = self.server.evaluation()
        return metrics

    def global_weights(self):
        if self.personalised:
            return personal_models(self.worker.algo, self.client_states)
        return self.server.global_weights()

    def export_state(self):
        return self.server.state, dict(self.client_states)

    def import_state(self, server_state, client_states) -> None:
        self.server.state = server_state
        self.client_states = dict(client_states)

    def describe(self) -> str:
        vec = describe_vectorised(self.worker.vectorize, self.worker.vectorize_min)
        return f"local: in-process on {self.device}, {self.threads} torch thread(s){vec}"

    def close(self) -> None:
        self._give_back()
