"""A method's client step as data, for tests that compute its loss by hand: the plan ``client_update`` returns for one
client of one round (after the rounds before it, so that teachers and client states exist), that client's first
batch, and the loss the plan computes on it at the round's starting weights."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from fedray.data import build_federated_data
from fedray.learning.training import CLIENT_INPUTS, LocalTraining, StepwiseTraining, split_loss
from fedray.runtime import make_runtime
from fedray.seeding import sample_clients
from tests.conftest import tiny_config


@dataclass
class Step:
    rt: Any  # the runtime (its worker's modules, its server)
    ctx: Any  # the client's ClientContext
    payload: Any
    state: Any  # the client's state going in
    plan: LocalTraining | StepwiseTraining
    x: torch.Tensor  # the client's first batch
    y: torch.Tensor

    def local_loss(self, moved: float = 0.0) -> tuple[torch.Tensor, dict]:
        """A LocalTraining's loss (and its figures) on the first batch, the model at the round's start, or
        ``moved`` away from it (seeded Gaussian noise of that std on every parameter): a term that compares the
        model with where it started (FedProx's) is 0 at the start, whatever its sign or weight."""
        model = self.plan.model
        model.load_state_dict(self.plan.start)
        if moved:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(moved * torch.randn(p.shape, generator=g).to(p.device))
        model.train()
        own = () if self.plan.client_inputs is None else (self.plan.client_inputs,)
        return split_loss(self.plan.loss(model, self.x, self.y, *own))

    def update_loss(self, update: int = 0) -> tuple[torch.Tensor, dict, dict]:
        """A StepwiseTraining's ``update``-th loss at step 0 (the modules at the round's start): (loss, figures,
        the step's inputs)."""
        for name, weights in self.plan.start.items():
            self.plan.modules[name].load_state_dict(weights)
        self.plan.modules.train()
        extra, flags = self.plan.inputs(0)
        inp = {"x": self.x, "y": self.y, **extra}
        if self.plan.client_inputs is not None:
            inp[CLIENT_INPUTS] = self.plan.client_inputs
        loss, figures = split_loss(self.plan.updates[update].loss(self.plan.modules, inp, flags))
        return loss, figures, inp


@contextmanager
def client_step(round_: int = 1, **overrides) -> Iterator[Step]:
    """The first client sampled in ``round_`` of tiny_config(**overrides), after rounds 1 .. round_ - 1."""
    cfg = tiny_config(**overrides)
    data = build_federated_data(cfg.data, cfg.seed)
    n, k = data.num_clients, cfg.federation.clients_per_round
    with make_runtime(cfg, data) as rt:
        for r in range(1, round_):
            rt.run_round(r, sample_clients(cfg.seed, r, n, k))
        payload, _ = rt.server.payload(round_ - 1)
        cid = sample_clients(cfg.seed, round_, n, k)[0]
        state = rt.client_states.get(cid)
        ctx, state = rt.worker._context(round_, cid, state)
        plan = rt.worker.algo.client_update(ctx, payload, state)
        x, y = next(iter(plan.batches if isinstance(plan, StepwiseTraining) and plan.batches else ctx.batches()))
        yield Step(rt, ctx, payload, state, plan, x, y)
