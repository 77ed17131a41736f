"""FedAvg (McMahan et al., 2017): local SGD on private data, sample-weighted parameter averaging.

Server update (the Eq. 6 of DaFKD, Alg. 1 line 9 of FedKF): w_{t+1} = sum_k |D_k| / sum_j |D_j| * w_k over
the clients that took part in round t. Stateless on the client side.

``algorithm.report_model=oca`` adds FedKF's cached-model aggregation (T1, :mod:`fedray.learning.cached`):
the server also keeps every client's latest upload and reports the OCA model ("FedAvg (OCA)", FedKF
Table XII); training and the broadcast model are unchanged. The default (``aca``) is plain FedAvg.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fedray.methods.api import (Algorithm, CacheParams, ClientContext, ClientResult, ClientState, LocalTraining,
                                ModelCache, Payload, ServerContext, ServerState, Trained, Upload, Weights, build_model,
                                client_states, clone_weights, counts_field, init_cache, label_counts, model_field,
                                update_cache, weights_only)


@dataclass
class ModelState(ServerState):
    """Server state: the global (ACA) model's weights, and the T1 cache when the method keeps one."""

    weights: Weights
    cache: ModelCache | None = None


@dataclass
class ModelPayload(Payload):
    weights: Weights = model_field(against=None)


@dataclass
class ModelUpload(Upload):
    weights: Weights = model_field(against="weights")  # trained from the payload's weights
    num_samples: int = counts_field()


@dataclass
class CachedUpload(ModelUpload):
    """An upload to a server that keeps T1 cache slots: it must know whose slot to overwrite."""

    client_id: int = -1


@dataclass
class LabelCountUpload(ModelUpload):
    """FedAvg's upload plus the client's label counts (FedGen's and FedFTG's label weights need them)."""

    label_counts: torch.Tensor = counts_field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # (C,) int64


def counted_upload(ctx: ClientContext, weights: Weights, num_classes: int,
                   of_batches: bool = False) -> LabelCountUpload:
    """The upload with the client's label counts: of its data, or (``of_batches``) of the round's batches."""
    y = ctx.y.cpu()[torch.cat(ctx.batch_plan().index)] if of_batches else ctx.y
    return LabelCountUpload(weights=weights, num_samples=ctx.num_samples, label_counts=label_counts(y, num_classes))


def received_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """w_t, a copy of the parameters as received: FedProx's anchor (FedFTG's clients with ``base=fedprox``)."""
    return [p.detach().clone() for p in model.parameters()]


def proximal_term(model: torch.nn.Module, anchor: list[torch.Tensor]) -> torch.Tensor:
    """||w - w_t||^2 over the parameters, FedProx's term before its mu / 2."""
    return sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))


@dataclass
class Modules:
    model: torch.nn.Module


class FedAvgParams(CacheParams):
    pass


class FedAvg(Algorithm[FedAvgParams, Modules]):
    """FedAvg, and the base of the local-SGD methods (FedProx, q-FFL, FedGKD, FedKF's warm-up, FedDF's clients).

    A client loads the broadcast weights and takes ``ctx.num_local_steps()`` optimizer steps of :meth:`local_loss`;
    its upload is :meth:`make_upload` of the trained weights. Subclasses change the update through three hooks:

    - :meth:`make_anchor`: what the loss compares against, from the payload alone (FedProx: the received weights;
      FedGKD: the teacher); the same for every client of the round.
    - :meth:`local_loss` with :attr:`local_loss_paddable`: the training objective, and whether every term of it
      that reads the batch averages over its rows not labelled ``IGNORE_LABEL`` only (then the vectorised runtime
      may pad short batches). A subclass that overrides ``local_loss`` must say so in its own class body:
      inheriting a "paddable" it never checked would silently change its numbers.
    - :meth:`make_upload`: the upload from the client's trained weights.

    ``client_update`` itself is overridden only to post-process the plan (q-FFL's upload, FedKF's distillation).
    """

    name = "fedavg"
    Params = FedAvgParams
    asynchronous = True  # its uploads are weights trained from the payload's: rebase moves their change (FedBuff)
    keeps_cache = True  # algorithm.report_model=oca: "FedAvg (OCA)" of FedKF Table XII
    robust_means = ("weights",)  # server_update's one mean, of models trained from state.weights

    @property
    def uses_cache(self) -> bool:
        """Keep T1 cache slots (:meth:`caches`)."""
        return type(self).caches(self.params)

    def build_modules(self) -> Modules:
        return Modules(model=build_model(self.cfg.model.name, self.spec.input_shape, self.spec.num_classes))

    def init_server_state(self, modules: Modules) -> ModelState:
        w0 = clone_weights(modules.model)
        if not self.uses_cache:
            return ModelState(weights=w0, cache=None)
        # at scale, the OCA model from a running sum and the slots beyond runtime.client_state_memory on disk
        running = self.cfg.data.on_demand or self.cfg.runtime.client_state_memory is not None
        cache = init_cache(w0, self.spec.num_clients, self.params.cache_init or "initial", running,
                           client_states(self.cfg, purpose="server_cache"))
        return ModelState(weights=w0, cache=cache)

    def broadcast(self, state: ModelState, round_: int) -> ModelPayload:
        return ModelPayload(weights=state.weights)

    def global_weights(self, state: ModelState) -> Weights:
        if state.cache is not None and self.params.report_model == "oca":
            return state.cache.oca
        return state.weights

    def extra_eval_models(self, state: ModelState) -> dict[str, Weights]:
        """With the cache: both the ACA and the OCA model, so one run gives both rows of Table XII."""
        if state.cache is None:
            return {}
        return {"aca": state.weights, "oca": state.cache.oca}

    # --- client: the local-SGD hooks ------------------------------------------------------------------
    #: Whether every term of :meth:`local_loss` that reads the batch averages over its rows not labelled
    #: IGNORE_LABEL only, as F.cross_entropy's row mean does (LocalTraining.paddable).
    local_loss_paddable: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "local_loss" in cls.__dict__ and "local_loss_paddable" not in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} overrides local_loss: set local_loss_paddable in its class body "
                            "(True only if every term reading the batch averages over rows not labelled IGNORE_LABEL)")

    def local_loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, anchor: Any) -> torch.Tensor:
        """The client's training objective; subclasses add terms (FedProx's proximal term)."""
        return F.cross_entropy(model(x), y)

    def make_anchor(self, model: torch.nn.Module, modules: Any = None, payload: Any = None) -> Any:
        """What the local loss may compare against (the received global model, a teacher), from the received
        ``model`` and the ``payload`` alone: the same for every client of the round, as the batched runtime calls
        one client's loss for all. ``modules``: the worker's modules (``ctx.modules``, one object for all its
        clients), where a teacher module to load lives; no client's data or state is offered. None for FedAvg."""
        return None

    def make_upload(self, ctx: ClientContext, weights: Weights) -> ModelUpload:
        """The upload from the client's trained ``weights`` (a copy of its model's state dict)."""
        if self.uses_cache:
            return CachedUpload(weights=weights, num_samples=ctx.num_samples, client_id=ctx.client_id)
        return ModelUpload(weights=weights, num_samples=ctx.num_samples)

    def client_update(self, ctx: ClientContext[Modules], payload: ModelPayload,
                      state: ClientState | None) -> LocalTraining:
        model = ctx.modules.model
        model.load_state_dict(payload.weights)
        model.train()
        anchor = self.make_anchor(model, ctx.modules, payload)  # from the payload alone: the same for every client

        @weights_only  # the model is read only through clone_weights
        def finish(m: torch.nn.Module, trained: Trained) -> ClientResult:
            return ClientResult(self.make_upload(ctx, clone_weights(m)), None, trained.means())

        return LocalTraining(model=model, start=payload.weights, loss=lambda m, x, y: self.local_loss(m, x, y, anchor),
                             finish=finish, paddable=self.local_loss_paddable)

    # --- server -------------------------------------------------------------------------------------
    def rebase(self, upload: ModelUpload, sent: ModelPayload, current: ModelState, weight: float) -> ModelUpload:
        """FedBuff (Nguyen et al. 2022, Alg. 1): the client's change Delta_k = w_k - w_sent, weighted, onto the current
        model: w_now + weight * Delta_k, in float64 then the weights' dtype. Averaged by samples (``server_update``)
        the step is w_now + sum_k p_k s(tau_k) Delta_k / sum_k p_k; fresh uploads of weight 1 give FedAvg's average
        exactly. Integer buffers are the client's."""
        out = {}
        for key, w in upload.weights.items():
            if torch.is_floating_point(w):
                change = w.double() - sent.weights[key].double()
                out[key] = (current.weights[key].double() + weight * change).to(w.dtype)
            else:
                out[key] = w
        return dataclasses.replace(upload, weights=out)

    def server_update(
        self, state: ModelState, uploads: list[ModelUpload], ctx: ServerContext
    ) -> tuple[ModelState, dict[str, float]]:
        # reference: the model the uploads were trained from (rebased onto it, asynchronously), for update rules
        weights = ctx.aggregation.mean([u.weights for u in uploads], [u.num_samples for u in uploads],
                                       reference=state.weights)
        if state.cache is None:
            return dataclasses.replace(state, weights=weights), {}
        cache = update_cache(state.cache, [u.client_id for u in uploads], [u.weights for u in uploads],
                             [u.num_samples for u in uploads], ctx.aggregation)
        return dataclasses.replace(state, weights=weights, cache=cache), {
            "server/cache_filled": float(len(cache.slots))}
