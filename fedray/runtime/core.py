"""The work of a client worker, as a plain object, and what the server's side (:mod:`fedray.runtime.server_core`)
shares with it.

The local runtime calls these directly; the Ray runtime wraps each in an actor. Sharing one code path is
what makes the two runtimes produce identical numbers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from fedray.methods import Algorithm, ClientContext, DataSpec, Experiment, resolve_experiment
from fedray.methods.api import ClientResult, ClientState, ModelBank, PooledImages, Weights
from fedray.adversary import malicious_clients
from fedray.adversary.data import backdoor, data_attack
from fedray.privacy.audit import membership_rows
from fedray.privacy.dpsgd import DPSGD
from fedray.channel.channel import Channel, build_channel
from fedray.config import ExperimentConfig
from fedray.data.federated import FederatedData
from fedray.errors import RunFailure
from fedray.evaluation import Evaluator, eval_layout
from fedray.models import build_model
from fedray.models.init import apply_init
from fedray.models.base import channels_last_if_faster
from fedray.learning.feedback import statistical_utility
from fedray.learning.training import ClientUpdate, LocalTraining
from fedray.learning.weights import nbytes
from fedray.vectorized.precision import at_local_precision, check_precision
from fedray.vectorized.policy import vectorize_enabled, vectorize_min_clients
from fedray.vectorized.engine import run_alone, train_vectorized
from fedray.seeding import derive_seed
from fedray.system.oort import UTILITY


log = logging.getLogger("fedray")


def data_spec(data: FederatedData) -> DataSpec:
    return DataSpec(
        input_shape=tuple(data.input_shape),
        num_classes=data.num_classes,
        num_clients=data.num_clients,
        mean=tuple(data.mean),
        std=tuple(data.std),
    )


def modules_to_device(modules: Any, device: torch.device, channels_last: bool = False) -> Any:
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


def build_method(exp: Experiment, data: FederatedData, device: torch.device) -> tuple[Algorithm, Any]:
    # The class travels with the experiment (cloudpickle) so algorithms registered by a user's script work too.
    cfg = exp.cfg
    algo = exp.build(data_spec(data))
    # Seeded so that the initial global model is a function of the run seed alone; numpy's global generator too, so
    # that a user's method or model drawing from it after set-up is a function of the seed as well (a resume
    # restores both: fedray.record.checkpoint.rng_state)
    torch.manual_seed(derive_seed(cfg.seed, "init") % (1 << 63))
    np.random.seed(derive_seed(cfg.seed, "init") % (1 << 32))
    modules = algo.build_modules()
    if cfg.model.init and hasattr(modules, "model"):  # model.init: the global model starts from given weights
        apply_init(modules.model, cfg.model.init, cfg.model.name, algo.spec.input_shape, algo.spec.num_classes)
    return algo, modules_to_device(modules, device, cpu_channels_last(cfg, device))


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
        self.algo, self.modules = build_method(exp, data, device)
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
