"""The work of a client worker and of the server, as plain objects.

The local runtime calls these directly; the Ray runtime wraps each in an actor. Sharing one code path is
what makes the two runtimes produce identical numbers.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedray.methods import Algorithm, ClientContext, DataSpec, Experiment, ServerContext, resolve_experiment
from fedray.methods.api import ClientResult, ClientState, ModelBank, PooledImages, Upload, Weights
from fedray.adversary import malicious_clients
from fedray.adversary.collude import Colluder
from fedray.adversary.config import COLLUDING_ATTACKS
from fedray.adversary.data import backdoor, data_attack
from fedray.adversary.forge import forged_setup_counts
from fedray.privacy.audit import membership_rows
from fedray.privacy.dpsgd import DPSGD
from fedray.channel.channel import Channel, build_channel
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import RunFailure
from fedray.evaluation import ClientScores, Evaluator, eval_layout
from fedray.models import build_model
from fedray.models.init import apply_init
from fedray.models.base import channels_last_if_faster
from fedray.learning.feedback import statistical_utility
from fedray.learning.training import ClientUpdate, LocalTraining
from fedray.learning.weights import leaves, nbytes
from fedray.vectorized.precision import at_local_precision, check_precision
from fedray.vectorized.policy import vectorize_enabled, vectorize_min_clients
from fedray.vectorized.engine import run_alone, train_vectorized
from fedray.seeding import derive_seed
from fedray.system.oort import UTILITY
from fedray.runtime.root import Root, RootTraining
from fedray.runtime.server_inputs import client_label_counts, diagnostic_probe, server_side_data


log = logging.getLogger("fedray")


def data_spec(data: FederatedData) -> DataSpec:
    return DataSpec(
        input_shape=tuple(data.input_shape),
        num_classes=data.num_classes,
        num_clients=data.num_clients,
        mean=tuple(data.mean),
        std=tuple(data.std),
    )


def _to_device(modules: Any, device: torch.device, channels_last: bool = False) -> Any:
    """The method's modules moved to ``device``; with ``channels_last`` (``runtime.cpu_channels_last`` on a
    CPU) also to the channels-last layout where that is faster (:func:`channels_last_if_faster`)."""
    for value in (vars(modules).values() if modules is not None else ()):
        if isinstance(value, torch.nn.Module):
            value.to(device)
            if channels_last:
                channels_last_if_faster(value)
        elif isinstance(value, ModelBank):  # builds its modules later, on this device
            value.device, value.channels_last = device, channels_last
    return modules


def experiment_channel(exp: Experiment) -> Channel:
    """The channel of a run: the experiment's own when it brings one, else the one its config describes."""
    return exp.channel if exp.channel is not None else build_channel(exp.cfg, exp.method.sends_label_counts(exp.params),
                                                                  exp.method.uploads_label_counts(exp.params))


def cpu_channels_last(cfg: ExperimentConfig, device: torch.device) -> bool:
    return cfg.runtime.cpu_channels_last and device.type == "cpu"


def _build(exp: Experiment, data: FederatedData, device: torch.device) -> tuple[Algorithm, Any]:
    # The class travels with the experiment (cloudpickle) so algorithms registered by a user's script work too.
    cfg = exp.cfg
    algo = exp.build(data_spec(data))
    # Seeded so that the initial global model is a function of the run seed alone.
    torch.manual_seed(derive_seed(cfg.seed, "init") % (1 << 63))
    modules = algo.build_modules()
    if cfg.model.init and hasattr(modules, "model"):  # model.init: the global model starts from given weights
        apply_init(modules.model, cfg.model.init, cfg.model.name, algo.spec.input_shape, algo.spec.num_classes)
    return algo, _to_device(modules, device, cpu_channels_last(cfg, device))


class ClientWorkerCore:
    """Builds the method's modules once and trains whichever client it is handed, one at a time.

    Per-client models are loaded into one module per architecture (:class:`ModelBank`), so a worker
    serving 1,000 clients holds a handful of modules; the clients' weights are their client state.
    """

    def __init__(self, experiment: Experiment | ExperimentConfig, data: FederatedData, device: torch.device):
        exp = resolve_experiment(experiment)
        cfg = exp.cfg
        check_precision(cfg.runtime.precision, device)
        self.cfg, self.data, self.device = cfg, data, device
        self.algo, self.modules = _build(exp, data, device)
        self.channel = experiment_channel(exp)
        self.models = ModelBank(self.algo.spec, device, cpu_channels_last(cfg, device))
        self.attack = data_attack(cfg, data.num_classes)  # the malicious clients' data, poisoned here where they run
        self.malicious = malicious_clients(cfg)
        self.vectorize = vectorize_enabled(cfg.runtime.vectorize, device)
        self.vectorize_min = vectorize_min_clients(cfg.runtime)
        self._utilities: dict[int, float] = {}  # Oort's U(i) of the clients being trained, until their info is made
        self._evaluator: Evaluator | None = None
        self._eval_models: dict[str, torch.nn.Module] = {}  # per architecture, apart from the modules clients train in
        self.server_x = None  # only methods whose clients hold the server data's images get them
        # a diagnostic's every-client images (never a method's): the worker's shared copy of the training split
        if self.algo.wants_pooled_images() and data.on_demand:
            raise RunFailure(f"data.partition: {cfg.algorithm.name} draws from every client's images (a simulation-"
                             "only contrast), which would make every client made on demand; use an eager partition")
        self.pooled = PooledImages(data.train_x, data.client_train) if self.algo.wants_pooled_images() else None
        if self.algo.clients_hold_server_images and data.server is not None:
            self.server_x = torch.from_numpy(np.array(data.server.x)).to(device)

    @at_local_precision
    def train(self, round_: int, client_id: int, payload: Any, state: ClientState | None,
              wire: Any = None) -> Done:
        """One client's work: ``payload`` as it came over the wire (decoded here, where the client runs), its
        update, and its upload encoded for the wire with its channel state ``wire``."""
        return self._train(round_, client_id, self.channel.decode_down(payload), state, wire,
                           self.channel.heard(payload))

    def _train(self, round_: int, client_id: int, payload: Any, state: ClientState | None, wire: Any,
               heard: dict[str, float] | None = None) -> Done:
        return self._outcomes([self._trained(round_, client_id, payload, state)], payload, [wire], heard)[0]

    def _trained(self, round_: int, client_id: int, payload: Any,
                 state: ClientState | None) -> tuple[ClientContext, ClientResult]:
        ctx, state = self._context(round_, client_id, state)
        return ctx, self._alone(ctx, self._update(ctx, payload, state))

    def _update(self, ctx: ClientContext, payload: Any, state: ClientState | None) -> ClientUpdate:
        """The method's update of this client; under Oort (``system.selection=oort``) the client's statistical
        utility is measured from the model it starts from, before it trains, and kept for its info."""
        update = self.algo.client_update(ctx, payload, state)
        if self.cfg.system.selection == "oort":
            u = statistical_utility(update, ctx.x, ctx.y, self.algo.spec.mean, self.algo.spec.std,
                                    self.cfg.federation.eval_batch_size)
            if u is None:
                raise RunFailure(f"system.selection=oort: {self.cfg.algorithm.name}'s client update gave no model "
                                 "to measure the client's losses on; use system.selection=uniform")
            self._utilities[ctx.client_id] = u
        return update

    def _alone(self, ctx: ClientContext, update: ClientUpdate) -> ClientResult:
        return run_alone(ctx, update, self.cfg.runtime.cuda_graphs, self._dp([ctx], [update]))

    def _dp(self, ctxs: list[ClientContext], updates: list[ClientUpdate]) -> DPSGD | None:
        """DP-SGD for these clients' plans where ``privacy.sample_clip`` is set (in place of the plain step, where the
        clients run); a client trained outside a plan is refused in one line."""
        if self.cfg.privacy.sample_clip is None:
            return None
        if any(isinstance(u, ClientResult) for u in updates):
            raise RunFailure(f"privacy.sample_clip: {self.cfg.algorithm.name}'s client update trained outside a "
                             "training plan (DaFKD's gradient penalty: algorithm.gp_weight > 0), where DP-SGD cannot "
                             "reach its gradients; drop privacy.sample_clip or that option")
        return DPSGD.of(self.cfg, ctxs)

    @at_local_precision
    def train_many(self, round_: int, client_ids: list[int], payload: Any, states: list[ClientState | None],
                   wires: list[Any] | None = None) -> list[Done]:
        """Train several clients of a round from one payload (decoded once; client-id order kept), each with its
        state and channel state. With ``runtime.vectorize`` on, the clients whose ``client_update`` returns a
        training plan and that share a module and a loss are trained in lockstep as one batched computation
        (:mod:`fedray.vectorized.engine`); otherwise one by one."""
        heard, payload = self.channel.heard(payload), self.channel.decode_down(payload)
        wires = wires if wires is not None else [None] * len(client_ids)
        if not self.vectorize or len(client_ids) < self.vectorize_min:
            done = [self._trained(round_, c, payload, s) for c, s in zip(client_ids, states)]
            return self._outcomes(done, payload, wires, heard)
        ctxs, plans, results = [], [], {}
        for cid, state in zip(client_ids, states):
            ctx, state = self._context(round_, cid, state)
            update = self._update(ctx, payload, state)
            if isinstance(update, ClientResult):  # not a plan (e.g. DaFKD with a gradient penalty): done already
                self._dp([ctx], [update])  # refused under DP-SGD
                results[cid] = ctx, update
            else:
                ctxs.append(ctx)
                plans.append(update)
        groups: dict[tuple, list[int]] = {}
        for i, plan in enumerate(plans):  # batched together: the same modules and loss
            modules = (plan.model,) if isinstance(plan, LocalTraining) else tuple(plan.modules.values())
            groups.setdefault((tuple(map(id, modules)), plan.group), []).append(i)
        chunk = self.cfg.runtime.vectorize_max_clients
        for members in groups.values():
            for s in range(0, len(members), chunk):
                part = members[s : s + chunk]
                chosen = [ctxs[i] for i in part]
                trained = train_vectorized(chosen, [plans[i] for i in part], pad=self.cfg.runtime.vectorize_pad,
                                           cuda_graphs=self.cfg.runtime.cuda_graphs,
                                           dp=self._dp(chosen, [plans[i] for i in part]))
                for i, result in zip(part, trained):
                    results[ctxs[i].client_id] = ctxs[i], result
        return self._outcomes([results[c] for c in client_ids], payload, wires, heard)

    def _outcomes(self, done: list[tuple[ClientContext, ClientResult]], payload: Any, wires: list[Any],
                  heard: dict[str, float] | None = None) -> list[Done]:
        """The clients' uploads through the channel's client side (here, where the clients run; stacked, one row a
        client), their new states, their infos (``bytes_up``: what the channel sent) and their new channel states.
        ``heard``: what the payload's packet announced (the adaptive clip's clip)."""
        encoded = self.channel.encode_up_many([result.upload for _, result in done], payload, wires,
                                              [ctx.client_id for ctx, _ in done], done[0][0].round if done else 0,
                                              heard)
        out = []
        for (ctx, result), (sent, wire) in zip(done, encoded):
            info = {"client": ctx.client_id, "num_samples": ctx.num_samples, "bytes_up": self.channel.nbytes(sent),
                    "has_state": result.state is not None, "pid": os.getpid(),
                    "work_samples": self.algo.client_samples(ctx)}  # the simulated system's samples_k
            if (u := self._utilities.pop(ctx.client_id, None)) is not None:
                info[UTILITY] = u
            info.update(result.metrics)
            out.append((sent, result.state, info, wire))
        return out

    def _context(self, round_: int, client_id: int, state: ClientState | None) -> tuple[ClientContext, ClientState | None]:
        x, y = self.data.client_data(client_id)
        if self.attack is not None:  # alone or batched, every client's context is made here: one poisoning
            x, y = self.attack.data(client_id, x, y)
        if state is None:
            state = self.algo.init_client_state(client_id)
        ctx = ClientContext(
            client_id=client_id,
            round=round_,
            seed=derive_seed(self.cfg.seed, "client", round_, client_id),
            x=torch.from_numpy(x).to(self.device),
            y=torch.from_numpy(y).to(self.device),
            spec=self.algo.spec,
            fed=self._federation(round_),
            device=self.device,
            modules=self.modules,
            architecture=self.cfg.model.client_architecture(client_id),
            models=self.models,
            server_x=self.server_x,
            pooled=self.pooled,
            poisson_batches=self.cfg.privacy.sample_clip is not None and self.cfg.privacy.sample_batches == "poisson",
        )
        return ctx, state

    def _federation(self, round_: int):
        """``federation.*`` as this round's clients see it: the scheduled learning rate."""
        return self.cfg.federation.at_round(round_)

    def evaluate_clients(self, client_ids: list[int], states: list[ClientState | None]) -> list[tuple]:
        """Personalised evaluation: each client's own model on its own test split and on the global test
        set (rows of :func:`fedray.evaluation.personal_metrics`, then the cross-entropy summed over the own
        test split, then under a backdoor the triggered test images it classifies as the target and their number:
        (0, 0) for a malicious client, whose own model is the attacker's, and without a backdoor; then the membership
        audit's U and pairs, (0, 0) without one). A client that never trained is scored with its initial model, which is built here and not kept."""
        evaluator = self._worker_evaluator()
        rows = []
        for cid, state in zip(client_ids, states):
            own = self.algo.personal_model(state if state is not None else self.algo.init_client_state(cid))
            model = self._eval_model(own.architecture)
            model.load_state_dict(own.weights)
            counts, loss_sum = evaluator.personal_scores(model, cid)
            attack = evaluator.attack_counts(model) if cid not in self.malicious else (0, 0)
            rows.append((*counts, loss_sum, *attack, *evaluator.membership_pairs(model, cid)))
        return rows

    def _worker_evaluator(self) -> Evaluator:
        if self._evaluator is None:
            self._evaluator = Evaluator(self.data, None, self.device, self.cfg.federation.eval_batch_size,
                                        backdoor=backdoor(self.cfg), members=membership_rows(self.cfg, self.data))
        return self._evaluator

    def _eval_model(self, architecture: str) -> torch.nn.Module:
        if architecture not in self._eval_models:
            self._eval_models[architecture] = eval_model(self.cfg, self.algo, self.device, architecture)
        return self._eval_models[architecture]

    def evaluate_global(self, models: dict[str, Weights], part: int, parts: int) -> dict[str, list]:
        """Part ``part`` of ``parts`` of a global-model evaluation spread over the workers (Ray): for each
        of ``models`` (see :func:`eval_models`), which samples of every ``part``-th fixed batch of the
        evaluation set it predicts right, as [(start, stop, correct, loss)], where loss is each sample's
        cross-entropy for the global model (suffix "", the one ``clients.parquet`` records) and None for the
        others. The batches are those the server scores in-process, so the figures are the same wherever the
        batches run."""
        evaluator = self._worker_evaluator()
        model = self._eval_model(self.cfg.model.name)
        ranges = evaluator.chunks()[part::parts]
        out = {}
        for suffix, weights in models.items():
            model.load_state_dict(weights)
            scored = evaluator.score(model.eval(), ranges, losses=suffix == "")
            out[suffix] = [(start, stop, o, ce) for (start, stop), (o, ce) in zip(ranges, scored)]
        return out


#: A client's work as a worker returns it: (upload as sent, new client state, info, new channel state).
Done = tuple[Any, "ClientState | None", dict, Any]


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
        self.algo, self.modules = _build(exp, data, device)
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
            self._root = RootTraining(self.cfg, self.algo, _to_device(modules, self.device, channels_last), self.device,
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

    def evaluate(self) -> dict[str, float]:
        return self.evaluation()[0]

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


def eval_model(cfg: ExperimentConfig, algo: Algorithm, device: torch.device,
               architecture: str | None = None) -> torch.nn.Module:
    """A module of the global architecture (or ``architecture``) to load weights into for evaluation only, in
    the memory layout its inference is fastest in (:func:`fedray.evaluation.eval_layout`). Built on first use, so
    under ``fork_rng``: when it is built never moves the global RNG (its initial weights are overwritten)."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(architecture or cfg.model.name, algo.spec.input_shape, algo.spec.num_classes)
    return eval_layout(model.to(device), device)


def eval_models(algo: Algorithm, state: Any) -> tuple[dict[str, Weights], dict[str, str]]:
    """({"": the global model, suffix: each other model to score}, {reported suffix: the scored model whose
    figures it gets}) from ``algo.global_weights`` and ``algo.extra_eval_models``. The reported model is
    often one of the extra ones (FedKF reports OCA): it is scored once."""
    main = algo.global_weights(state)
    models, report = {"": main}, {}
    for suffix, weights in algo.extra_eval_models(state).items():
        if weights is not main:
            models[suffix] = weights
        report[suffix] = suffix if weights is not main else ""
    return models, report


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


def summarise_clients(infos: list[dict]) -> dict[str, float]:
    """Round metrics from the clients' infos: bytes up in total, other ``scope/name`` keys sample-weighted."""
    out: dict[str, float] = {"comm/bytes_up": float(sum(i["bytes_up"] for i in infos))}
    n = np.array([i["num_samples"] for i in infos], dtype=np.float64)
    for key in sorted({k for i in infos for k in i if "/" in k}):
        vals = np.array([i.get(key, np.nan) for i in infos], dtype=np.float64)
        ok = ~np.isnan(vals)
        if ok.any():
            out[key] = float((vals[ok] * n[ok]).sum() / n[ok].sum())
    return out
