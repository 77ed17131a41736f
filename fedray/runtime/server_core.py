"""The work of the server, as a plain object (:class:`ServerCore`): the local runtime calls it directly, the Ray
runtime wraps it in an actor (:mod:`fedray.runtime.actors`) or hosts it in the driver
(:mod:`fedray.runtime.server_host`), so the runtimes produce identical numbers."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedray.methods import Algorithm, Experiment, ServerContext, resolve_experiment
from fedray.methods.api import Weights
from fedray.adversary import malicious_clients
from fedray.adversary.collude import Colluder
from fedray.adversary.config import COLLUDING_ATTACKS
from fedray.adversary.data import backdoor, data_attack
from fedray.adversary.forge import forged_setup_counts
from fedray.privacy.audit import membership_rows
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import RunFailure
from fedray.evaluation import ClientScores, Evaluator
from fedray.learning.weights import leaves, nbytes
from fedray.seeding import derive_seed
from fedray.runtime.root import Root, RootTraining
from fedray.runtime.server_inputs import client_label_counts, diagnostic_probe, server_side_data
from fedray.runtime.core import (build_method, cpu_channels_last, eval_model, eval_models, experiment_channel,
                                 modules_to_device)

log = logging.getLogger("fedray")


@dataclass
class Sent:
    """A payload sent to clients: the method's, as sent (after the channel's stages), its bytes, and as the clients
    decoded it (what their uploads are updates against)."""

    payload: Any
    wire: Any
    nbytes: int
    decoded: Any
    wire_before: Any = None  # the channel's server state it was sent from (downlink error feedback)

class ServerCore:
    """Holds the server state; sends payloads, takes server steps, evaluates the global model."""

    def __init__(self, experiment: Experiment | ExperimentConfig, data: FederatedData, device: torch.device):
        exp = resolve_experiment(experiment)
        self.cfg, self.device = exp.cfg, device
        self.algo, self.modules = build_method(exp, data, device)
        self.algo.server_data = server_side_data(data, device)
        self.malicious = malicious_clients(self.cfg)  # adv/* figures; lie / min_max forge at the server
        if exp.method.sends_label_counts(exp.params):  # as the clients hold their data (a data attack's labels)
            counts = torch.from_numpy(client_label_counts(data, data_attack(self.cfg, data.num_classes)))
            # and as the malicious send them (forge_histogram)
            self.algo.client_label_counts = forged_setup_counts(counts, self.cfg.adversary, self.malicious).to(device)
        # Labels of the server's data for diag/* only (hidden from the method when unlabelled).
        self.server_labels = (torch.from_numpy(np.array(data.server.y)).to(device)
                              if data.server is not None and data.server.y is not None else None)
        self.state = self.algo.init_server_state(self.modules)
        self.channel = experiment_channel(exp)
        self.sent: dict[int, Sent] = {}  # what was sent, by server version, while clients train from it
        self.wire_state = self.channel.init_server_state()  # the channel's server side (downlink error feedback)
        self.probe = diagnostic_probe(data, self.algo, self.cfg.seed, device, data_attack(self.cfg, data.num_classes))
        self.data = data
        self.collude = Colluder(self.cfg.adversary, self.malicious) if self.cfg.adversary.attack in COLLUDING_ATTACKS \
            else None
        self._evaluator: Evaluator | None = None  # built on first use: on Ray the workers usually evaluate
        self._root: RootTraining | None = None  # FLTrust's pseudo-client (aggregation.rule=fltrust), built on first use

    def payload(self, version: int) -> tuple[Any, int]:
        """What is sent to a client training from the model after ``version`` server steps (the method's broadcast
        for round version + 1, through the channel's server side, once per broadcast) and its bytes. Kept while a
        client trains from it: an upload is rebased on it, as the clients decoded it, when it arrives."""
        if version not in self.sent:
            self.sent[version] = self._send(self.algo.broadcast(self.state, version + 1), version)
        return self.sent[version].wire, self.sent[version].nbytes

    def _send(self, payload: Any, version: int) -> "Sent":
        before = self.wire_state
        wire, self.wire_state = self.channel.encode_down(payload, version, before)
        return Sent(payload, wire, self.channel.nbytes(wire), self.channel.decode_down(wire), before)

    def step(self, round_: int, uploads: list[Any], client_ids: list[int], versions: list[int],
             weights: list[float] | None, live: list[int]) -> dict[str, float]:
        """One server step: the uploads as they arrived (the channel's server side), each rebased
        (:meth:`Algorithm.rebase`) from the payload of its ``versions`` entry onto the current state with its change
        times its weight when ``weights`` are given (stale uploads), then the method's server update. The payloads
        of versions not in ``live`` (no client trains from them any more) are dropped."""
        arrived = [self.channel.decode_up(u, self.sent[v].decoded) for u, v in zip(uploads, versions)]
        if self.collude is not None:  # a colluding adversary forges from the step's updates before aggregation
            arrived = self.collude(arrived, client_ids, [self.sent[v].decoded for v in versions])
        if weights is not None:
            arrived = [self.algo.rebase(u, self.sent[v].decoded, self.state, w)
                       for u, v, w in zip(arrived, versions, weights)]
        metrics = self.aggregate(round_, arrived, client_ids)
        # the listening stages' server state from what the uploads told (the adaptive clip's next clip), after the
        # step, whose central noise used the clip its uploads were clipped at
        self.wire_state = self.channel.hear(self.wire_state, uploads, round_)
        self.sent = {v: p for v, p in self.sent.items() if v in set(live)}
        return metrics

    def export_state(self) -> tuple[Any, dict[int, Any], Any]:
        """(server state, {version: the method's payload and the channel's server state it was sent from} of the
        versions clients train from, the channel's server state now) for a checkpoint: a resume encodes those
        payloads again, to the same packets."""
        sent = {v: {"payload": p.payload, "channel": p.wire_before} for v, p in self.sent.items()}
        return self.state, sent, self.wire_state

    def import_state(self, state: Any, sent: dict[int, Any], wire: Any) -> None:
        self.state = state
        self.sent = {}
        for v, kept in sent.items():
            if isinstance(kept, (list, tuple)):  # a checkpoint of a fedray without the channel: (payload, bytes)
                kept = {"payload": kept[0], "channel": None}
            self.wire_state = kept["channel"]
            self.sent[int(v)] = self._send(kept["payload"], int(v))
        self.wire_state = wire

    def aggregate(self, round_: int, uploads: list[Any], client_ids: list[int]) -> dict[str, float]:
        """Reject non-finite uploads, then run the method's server update on the rest (client-id order). No upload
        at all (the simulated system let none arrive): the state stays as it is."""
        if not uploads:
            return {}
        pairs = [(u, c) for u, c in zip(uploads, client_ids) if is_finite(u) or _reject(round_, c)]
        kept, kept_ids = [u for u, _ in pairs], [c for _, c in pairs]
        if not kept:
            raise RunFailure(f"round {round_}: every upload was non-finite (clients {', '.join(map(str, client_ids))}); "
                             "the run stops with its last good checkpoint intact; lower federation.lr or check the data")
        ctx = ServerContext(round=round_, seed=derive_seed(self.cfg.seed, "server", round_), device=self.device,
                            modules=self.modules, cuda_graphs=self.cfg.runtime.cuda_graphs,
                            aggregation=self.channel.aggregation)
        announced = self.channel.announce(self.wire_state)
        self.channel.aggregation.start_step(round_, announced)
        root = self._root_update(round_) if self.channel.aggregation.needs_root else None
        self.state, metrics = self.algo.server_update(self.state, kept, ctx)
        if "clip" in announced:  # the adaptive clip the step's uploads were clipped at
            metrics["privacy/clip"] = announced["clip"]
        if self.malicious:
            metrics["adv/malicious_uploads"] = float(sum(c in self.malicious for c in kept_ids))
            chosen = ctx.aggregation.kept  # Krum's choice, as indices of the uploads (client-id order)
            if chosen is not None:
                metrics["adv/malicious_kept"] = float(sum(kept_ids[i] in self.malicious for i in chosen))
        metrics.update(self.channel.aggregation.step_metrics())  # agg/*: what the rule saw (FLTrust's trust scores)
        diag: dict[str, float] = {}
        if self.cfg.federation.diagnoses(round_):
            if self.server_labels is not None:
                diag.update(self.algo.server_diagnostics(ctx, self.server_labels))
            if self.probe is not None:
                diag.update(self.algo.probe_diagnostics(ctx, self.probe, kept_ids))
        assert all(k.startswith("diag/") for k in diag), "simulation-only diagnostics are logged under diag/*"
        metrics.update(diag)
        if self.cfg.system.enabled:  # the server's work, for the simulated clock (system.server_sps)
            # FLTrust's root training is the server's work too: its examples count as the method's server work does
            metrics["sim/server_samples"] = float(self.algo.server_samples(len(kept)) + (root.samples if root else 0))
        return {**metrics, "health/rejected_updates": float(len(uploads) - len(kept))}

    def _root_update(self, round_: int) -> Root:
        """FLTrust's g_0 of this step (:mod:`fedray.runtime.root`), trained from the current model (the one the step's
        uploads are updates of: synchronously the one broadcast for this round, asynchronously the one they were
        rebased onto) and handed to the rule. The pseudo-client's modules are built once, apart from the server's, as
        a worker's are, under ``fork_rng``: building them never moves the global RNG."""
        if self._root is None:
            with torch.random.fork_rng(devices=[]):
                modules = self.algo.build_modules()
            channels_last = cpu_channels_last(self.cfg, self.device)
            self._root = RootTraining(self.cfg, self.algo, modules_to_device(modules, self.device, channels_last), self.device,
                                      channels_last)
        root = self._root.update(round_, self.algo.broadcast(self.state, round_))
        self.channel.aggregation.begin_step(root.update)
        return root

    @property
    def evaluator(self) -> Evaluator:
        assert not self.algo.personalised, "personalised methods are evaluated where the clients' models are"
        if self._evaluator is None:
            model = eval_model(self.cfg, self.algo, self.device)
            self._evaluator = Evaluator(self.data, model, self.device, self.cfg.federation.eval_batch_size,
                                        backdoor=backdoor(self.cfg), members=membership_rows(self.cfg, self.data))
        return self._evaluator

    def eval_models(self) -> tuple[dict[str, Weights], dict[str, str]]:
        """The models an evaluation scores and how they are reported: see :func:`eval_models`."""
        return eval_models(self.algo, self.state)

    def evaluation(self) -> tuple[dict[str, float], ClientScores]:
        """``eval/*`` (see :func:`report_eval`) and the global model's per-client figures."""
        models, report = self.eval_models()
        scored, clients = {}, None
        for suffix, weights in models.items():
            if suffix == "":
                scored[suffix], clients = self.evaluator.evaluation(weights)
            else:
                scored[suffix] = self.evaluator.evaluate(weights)
        return report_eval(scored, report), clients

    def global_weights(self) -> Weights | None:
        return self.algo.global_weights(self.state)


def report_eval(scored: dict[str, dict[str, float]], report: dict[str, str]) -> dict[str, float]:
    """``eval/*`` of the global model, then ``eval/*_<suffix>`` of each extra model (see :func:`eval_models`)."""
    metrics = dict(scored[""])
    for suffix, source in report.items():
        metrics.update({f"{k}_{suffix}": v for k, v in scored[source].items()})
    return metrics


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def is_finite(obj: Any) -> bool:
    """No NaN or inf in any floating tensor or float of an upload. CPU tensors are checked by numpy, at a tenth of
    torch's cost per call (a round checks every tensor of every upload: 11 ms for 32 LeNet-5 uploads by torch)."""
    for x in leaves(obj):
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x):
            if x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS:
                ok = bool(np.isfinite((x.detach() if x.requires_grad else x).numpy()).all())
            else:
                ok = bool(torch.isfinite(x).all())
            if not ok:
                return False
        if isinstance(x, float) and not math.isfinite(x):
            return False
    return True


def _reject(round_: int, client_id: int) -> bool:
    log.warning("round %d: rejected a non-finite upload from client %d", round_, client_id)
    return False
