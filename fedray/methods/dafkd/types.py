"""DaFKD's typed parameters and state: what crosses its client/server boundary (:mod:`fedray.methods.dafkd.method`
documents the method; the client's and the server's steps import these types)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from fedray.methods.api import (ClientState, DataSpec, FedModel, Payload, ServerState, Upload, Weights, counts_field,
                                model_field, values_field)


class DaFKDParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sharing: bool = Field(default=True, description="discriminator head on the classifier's extractor (Sec. 3.4)")
    correlation: bool = Field(default=True, description="Eq. 7 weights; false = uniform (Table 3 no-correlation)")
    private_discriminator: bool = Field(default=False, description="Appendix B: upload f*s and f, not theta^d")
    ensemble: Literal["probs", "logits"] = Field(default="probs", description="paper: probs; authors' code: logits")
    aggregation: Literal["uniform", "samples"] = Field(default="uniform", description="Eq. 4/6: 1/K_t; code: |D_k|")
    generator: Literal["conditional", "dcgan"] = Field(
        default="conditional", description="the paper's conditional fully-connected generator, or the authors' DCGAN")
    noise_dim: int = Field(default=100, ge=1)
    gen_hidden: int = Field(default=256, ge=2, description="conditional generator: hidden width (paper: not given)")
    gen_width: int = Field(default=64, ge=1, description="DCGAN width w: 4w-2w-w channels (authors' code: 64)")
    gen_lr: float = Field(default=0.001, gt=0, description="generator Adam lr (betas 0.5, 0.999)")
    disc_lr: float = Field(default=0.001, gt=0, description="discriminator head / network lr")
    gen_weight_decay: float | None = Field(default=None, ge=0, description="the generator's Adam weight decay; None: "
                                           "federation.weight_decay, as the classifier's (the authors' code: their "
                                           "--wd, 1e-4, on the generator only, none on classifier and discriminator)")
    gen_loss: Literal["nonsaturating", "minimax"] = "nonsaturating"
    gen_class_weight: float = Field(default=0.0, ge=0, description="an extension, not the paper's: Eq. 3 plus this "
                                    "weight times the cross-entropy of the client's classifier on G(z, y) against y, "
                                    "so that a conditional generator's samples carry their class; 0 = the paper's")
    gp_weight: float = Field(default=0.0, ge=0, description="gradient penalty weight (authors' code: 0.3)")
    disc_train_rounds: int | None = Field(default=None, ge=0, description="train D only in rounds 1..N (code: 3)")
    gen_train_rounds: int | None = Field(default=None, ge=0, description="train G only in rounds 1..N (code: 5)")
    gan_local_epochs: int | None = Field(default=None, ge=0, description="in those rounds, D and G steps only in "
                                         "the first N local epochs (code: 5 of 20)")
    kd_reduction: Literal["batchmean", "mean"] = Field(default="batchmean", description="Eq. 8's KL: summed over "
                                                       "classes (batchmean) or averaged over them too (code: mean)")
    distill_samples: int = Field(default=1024, ge=1, description="size of the generated distillation set")
    distill_steps: int = Field(default=100, ge=0)
    distill_batch_size: int = Field(default=64, ge=1)
    distill_lr: float = Field(default=0.01, gt=0)
    distill_optimizer: Literal["sgd", "adam"] = Field(default="sgd", description="sgd has momentum 0.9")
    temperature: float = Field(default=1.0, gt=0)
    distill_start_round: int = Field(default=1, ge=1, description="authors' code: 2 (no distillation in round 1)")
    alpha_eps: float = Field(default=1e-8, gt=0, description="added to every f_k in Eq. 7")
    alpha_source: Literal["discriminator", "theorem1", "label_share", "uniform"] = Field(
        default="discriminator", description="Eq. 7's weights from the clients' discriminators (the method), from "
        "Theorem 1's optimal discriminators under the run's label distributions (every client's label counts sent "
        "once before round 1), from each client's share of the sample's class (the clients upload their label "
        "counts; 'oracle' before), or uniform (no correlation)")
    distill_data: Literal["generated", "proxy"] = Field(
        default="generated", description="distil on the generator's samples (the method) or on distill_samples "
        "real images a round from the server's unlabelled data.server_data (isolates the generator)")
    disc_head: Literal["own", "averaged"] = Field(
        default="own", description="sharing: each client's own head, kept across rounds (Alg. 1 line 18), or one "
        "head averaged by the server like the classifier and broadcast (the nearest order-free form of the authors' "
        "code, whose one head passes from client to client in a shared trainer object, never averaged)")
    eval_average: bool = Field(default=False, description="also evaluate the averaged model (eval/*_avg)")
    diag_samples: int = Field(default=100, ge=0, description="diag/*: real training images per client (and 10x "
                              "test images) for the simulation-only diagnostics of Eq. 7; 0 = none")
    disc_negatives: Literal["generated", "pooled"] = Field(
        default="generated", description="Eq. 2's negatives: the generator's samples (the method), or real images "
        "drawn from the mixture p of every client's data (pooled: a diagnostic that breaks privacy, not a method; "
        "the discriminators as if the generator had reached p, as Theorem 1 assumes)")
    disc_negatives_grad: Literal["shared", "detached"] = Field(
        default="shared", description="with sharing: Eq. 2's negatives (pooled or generated) reach the discriminator "
        "head through the classifier's feature extractor with gradients into it (shared, as Eq. 9 trains both "
        "jointly), or their features are computed without gradient (detached: the head still trains on them, the "
        "extractor learns only from the client's own images; what makes disc_negatives=pooled leave the "
        "classifiers untouched by other clients' data)")
    diag_reader: bool = Field(default=False, description="diag/reader_*: the fixed reader (fedray.reader, trained "
                              "once per dataset, then cached) scores each diagnosed round's generated samples")

    @field_validator("alpha_source", mode="before")
    @classmethod
    def _former_name(cls, value: Any) -> Any:
        """``oracle`` is the label-share weighting's former name: configs and checkpoints written with it load."""
        return "label_share" if value == "oracle" else value


# --- typed state (tensors, dicts of tensors, ints, None: checkpointable without pickle) ---------------


@dataclass
class DaFKDModules:
    model: FedModel  # classifier w (student on the server)
    generator: nn.Module  # theta^g: ConditionalGenerator (the paper's) or DCGANGenerator (the authors' code)
    disc: nn.Module  # sharing: Linear(feature_dim, 1) on model.features; else a separate network


@dataclass
class DaFKDServerState(ServerState):
    weights: Weights  # w_t, the global classifier
    generator: Weights  # theta^g_t, the global generator
    average: Weights | None = None  # w_hat_t before distillation (kept only with eval_average)
    disc: Weights | None = None  # disc_head=averaged: the averaged discriminator head, broadcast


@dataclass
class DaFKDPayload(Payload):
    weights: Weights = model_field(against=None)
    generator: Weights = model_field(against=None)
    distill_seed: int | None = None  # only the private variant needs (and is sent) the shared noise seed
    disc: Weights | None = model_field(against=None, default=None)  # disc_head=averaged: every client's start


@dataclass
class DaFKDUpload(Upload):
    weights: Weights = model_field(against="weights")  # w_t^k
    generator: Weights = model_field(against="generator")  # theta^g_k
    num_samples: int = counts_field()
    # main variant with correlation: theta^d_k (the head only with sharing), trained from the payload's head with
    # disc_head=averaged; the client's own (the payload's is None) otherwise
    disc: Weights | None = model_field(against="disc", default=None)
    # private: (f_k + eps) * s_k on the distillation set (N, C)
    weighted_outputs: torch.Tensor | None = values_field(default=None)
    output_weights: torch.Tensor | None = values_field(default=None)  # private with correlation: f_k + eps (N,)
    # alpha_source=label_share: the client's label counts (C,) int64
    label_counts: torch.Tensor | None = counts_field(default=None)
    client_id: int | None = None  # alpha_source=theorem1: whose upload (the server holds every client's counts)


@dataclass
class DaFKDClientState(ClientState):
    client_id: int
    disc: Weights  # theta^d_k: the head (sharing) or the whole separate network; never averaged, never sent
    rounds: int = 0  # rounds this client has trained in


class DaFKDMethod(Protocol):
    """What DaFKD's client and server steps (:mod:`~fedray.methods.dafkd.client`, :mod:`~fedray.methods.dafkd.server`)
    read of the method, :class:`fedray.methods.dafkd.method.DaFKD`, so that they need not import it: its settings and
    the parts of it both sides share."""

    params: DaFKDParams
    spec: DataSpec
    cfg: Any  # the run's ExperimentConfig
    client_label_counts: torch.Tensor | None  # the server's, with alpha_source=theorem1 (Algorithm.sends_label_counts)

    @property
    def weighting(self) -> str: ...

    def disc_logits(self, m: DaFKDModules, x: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor: ...

    def distillation_set(self, m: DaFKDModules, generator: Weights, seed: int, device: torch.device) -> torch.Tensor: ...

    def distillation_data(self, m: DaFKDModules, generator: Weights, round_: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def client_outputs(self, m: DaFKDModules, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...
