"""Isolated training: every client trains only its own model on its own data; nothing is exchanged.

This is the "trained in isolation" row of FedCD (Table I): the gain of a collaborative method is measured
against it, client by client. Each client owns a model of its own architecture (``model.client_models``,
assigned round-robin; else ``model.name``), initialised from (run seed, client) alone; its weights are the
client's private state and persist across the rounds it is sampled in. Local training is the engine's
supervised step (cross-entropy, ``federation.*`` optimizer, ``federation.local_steps`` or
``local_epochs``). The broadcast and the uploads are empty, so communication is 0 bytes.

``eval/*`` is personalised: each client's own model on its own test split (AMP / FM / WLP) and on the
global test set (``eval/accuracy`` = the mean over clients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from fedray.methods.api import (ClientContext, ClientResult, LocalTraining, Payload, PersonalModel,
                                PersonalisedAlgorithm, ServerContext, ServerState, Upload, weights_only)


@dataclass
class NoServerState(ServerState):
    """The isolated baseline has no server state."""


@dataclass
class EmptyPayload(Payload):
    """Nothing is sent down."""


@dataclass
class EmptyUpload(Upload):
    """Nothing is sent up."""


class Local(PersonalisedAlgorithm):
    name = "local"
    synchronous_because = "isolated training aggregates nothing"
    mean_only_because = "isolated training aggregates nothing"

    def init_server_state(self, modules: None) -> NoServerState:
        return NoServerState()

    def broadcast(self, state: NoServerState, round_: int) -> EmptyPayload:
        return EmptyPayload()

    def client_update(self, ctx: ClientContext, payload: EmptyPayload, state: PersonalModel) -> LocalTraining:
        return self.own_training(ctx, state, lambda m, x, y: F.cross_entropy(m(x), y),
                                 weights_only(lambda m, metrics, new: ClientResult(EmptyUpload(), new, metrics)),
                                 paddable=True)


    def server_update(self, state: NoServerState, uploads: list[EmptyUpload],
                      ctx: ServerContext) -> tuple[NoServerState, dict[str, float]]:
        return state, {}
