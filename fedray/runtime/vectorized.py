"""Vectorised clients: a worker trains its clients of a round in lockstep, as one batched computation.

Each client's update is a :class:`~fedray.algorithms.training.LocalTraining` (start weights, a loss,
``ctx.batches()``); clients that share a module and a loss are trained together:

- parameters, buffers and optimizer state are stacked along a leading client axis; one step is
  ``vmap(functional_call(model, ...))`` over the clients' batches, one ``backward`` of the summed losses
  (the clients' losses are independent, so each client's rows of the stacked gradient are its own
  gradient), and an element-wise optimizer step on the stacked tensors that follows ``torch.optim``'s
  SGD (momentum, weight decay) and Adam (L2 weight decay) step for step;
- BatchNorm running statistics are buffers of the stack: every client keeps its own;
- a client with fewer steps (``local_epochs`` over less data) is masked once done: its parameters,
  buffers and optimizer state stay as they were, it is never padded with extra updates; clients whose
  batch of a step is shorter (a pass ending on a short batch) run as their own vmap group in that step.

So the numbers are those of the sequential runner up to float rounding. On a GPU one batched kernel
replaces K small ones (kernel launches, not arithmetic, set the pace of small models); on a CPU it does
not pay (``runtime.vectorize=auto`` keeps CPU runs sequential).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.func import functional_call, vmap

from fedray.algorithms.base import Algorithm, ClientContext, ClientResult
from fedray.algorithms.training import LocalTraining, split_loss, step_means
from fedray.config import FederationConfig

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, which make_optimizer uses


class _LossModule(torch.nn.Module):
    """``loss(model, x, y)`` as a module, so ``functional_call`` swaps the model's parameters and buffers
    for one client's slice everywhere the loss looks: ``model(x)``, ``model.features``, ``model.parameters()``
    (FedProx's proximal term)."""

    def __init__(self, model: torch.nn.Module, loss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.loss(self.model, x, y)


class StackedOptimizer:
    """``federation.*``'s optimizer applied to stacked per-client tensors, with a per-client mask.

    The arithmetic is ``torch.optim.SGD``/``Adam``'s single-tensor step, element-wise, so a client's rows
    evolve as its own optimizer would move them; masked rows (clients already done) do not move.
    """

    def __init__(self, params: dict[str, torch.Tensor], fed: FederationConfig):
        self.params, self.fed = params, fed
        self.adam = fed.optimizer == "adam"
        n = next(iter(params.values())).shape[0]
        self.steps = torch.zeros(n, dtype=torch.float64)  # per client: Adam's bias correction
        self.state: dict[str, list[torch.Tensor | None]] = {k: [None, None] for k in params}

    @torch.no_grad()
    def step(self, active: torch.Tensor | None) -> None:
        """One step for the clients where ``active`` (bool, (K,)) is True; None: all of them."""
        fed = self.fed
        if active is not None:
            self.steps += active.cpu().double()
        else:
            self.steps += 1
        for key, p in self.params.items():
            g = p.grad
            if g is None:  # a parameter the loss never used: torch.optim skips it too
                continue
            if fed.weight_decay:
                g = g.add(p, alpha=fed.weight_decay)
            new_p, new_state = (self._adam if self.adam else self._sgd)(key, p, g, active)
            if active is None:
                p.copy_(new_p)
                self.state[key] = new_state
            else:
                mask = active.view(-1, *[1] * (p.dim() - 1))
                p.copy_(torch.where(mask, new_p, p))
                self.state[key] = [s_new if s_old is None else torch.where(mask, s_new, s_old)
                                   for s_new, s_old in zip(new_state, self.state[key])]

    def _sgd(self, key, p, g, active):
        buf = self.state[key][0]
        if self.fed.momentum:
            buf = g.clone() if buf is None else buf.mul(self.fed.momentum).add_(g)
            g = buf
        return torch.add(p, g, alpha=-self.fed.lr), [buf, None]

    def _adam(self, key, p, g, active):
        (b1, b2), lr = ADAM_BETAS, self.fed.lr
        m, v = self.state[key]
        m = torch.zeros_like(p) if m is None else m
        v = torch.zeros_like(p) if v is None else v
        m = m.lerp(g, 1 - b1)
        v = v.mul(b2).addcmul_(g, g, value=1 - b2)
        steps = self.steps if active is None else self.steps.clamp_min(1)
        if bool((steps == steps[0]).all()):  # the common case: torch's scalar arithmetic exactly
            t = float(steps[0])
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(ADAM_EPS)
            return torch.addcdiv(p, m, denom, value=-lr / (1 - b1**t)), [m, v]
        shape = (-1, *[1] * (p.dim() - 1))
        bc1 = (1 - b1**steps).to(p.dtype).to(p.device).view(shape)
        bc2 = (1 - b2**steps).sqrt().to(p.dtype).to(p.device).view(shape)
        denom = (v.sqrt() / bc2).add_(ADAM_EPS)
        return p - (lr / bc1) * (m / denom), [m, v]


def _lockstep_batches(ctxs: list[ClientContext]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor] | None]]:
    """Step by step, each client's next batch (None once it has taken all its steps)."""
    gens = [ctx.batches() for ctx in ctxs]
    for s in range(max(ctx.num_local_steps() for ctx in ctxs)):
        yield [next(g) if s < ctx.num_local_steps() else None for g, ctx in zip(gens, ctxs)]


def train_vectorized(ctxs: list[ClientContext], plans: list[LocalTraining]) -> list[ClientResult]:
    """Run ``plans`` (one per client, all of one ``(model, group)`` and one round) in lockstep; each client's
    ``finish`` is called in order with the module holding that client's trained weights."""
    model, loss = plans[0].model, plans[0].loss
    device = ctxs[0].device
    n = len(plans)
    model.load_state_dict(plans[0].start)  # non-persistent buffers, if any, come from here
    model.train()
    state_keys = set(model.state_dict())
    pnames = [k for k, _ in model.named_parameters()]
    bnames = [k for k, _ in model.named_buffers()]

    def stack(key: str, current: torch.Tensor) -> torch.Tensor:
        rows = [p.start[key] if key in p.start else current for p in plans]
        return torch.stack([r.detach().to(device) for r in rows])

    own = dict(model.named_parameters())
    params = {k: stack(k, own[k]).requires_grad_(True) for k in pnames}
    bufs = dict(model.named_buffers())
    buffers = {k: stack(k, bufs[k]) for k in bnames}
    opt = StackedOptimizer(params, ctxs[0].fed)
    wrapper = _LossModule(model, loss)

    def one_client(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor):
        out = functional_call(wrapper, ({f"model.{k}": v for k, v in p.items()},
                                        {f"model.{k}": v for k, v in b.items()}), (x, y))
        return split_loss(out)

    batched = vmap(one_client, randomness="different")
    sums: dict[str, torch.Tensor] = {}
    counts = torch.tensor([ctx.num_local_steps() for ctx in ctxs], dtype=torch.float64)
    for step_batches in _lockstep_batches(ctxs):
        for p in params.values():
            p.grad = None
        total = torch.zeros((), device=device)
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(step_batches):
            if b is not None:
                groups.setdefault(int(b[0].shape[0]), []).append(i)
        everyone = len(groups) == 1 and len(next(iter(groups.values()))) == n
        for members in groups.values():
            x = torch.stack([step_batches[i][0] for i in members])
            y = torch.stack([step_batches[i][1] for i in members])
            if everyone:
                losses, aux = batched(params, buffers, x, y)
            else:
                idx = torch.tensor(members, device=device)
                sub_b = {k: v[idx] for k, v in buffers.items()}
                losses, aux = batched({k: v[idx] for k, v in params.items()}, sub_b, x, y)
                for k, v in sub_b.items():  # BatchNorm statistics updated in the gathered copy
                    buffers[k][idx] = v
            total = total + losses.sum()
            for key, value in {"train/loss": losses, **aux}.items():
                acc = sums.setdefault(key, torch.zeros(n, dtype=torch.float64, device=device))
                acc.index_add_(0, torch.tensor(members, device=device), value.detach().to(torch.float64))
        total.backward()
        active = None
        if not everyone:
            active = torch.zeros(n, dtype=torch.bool, device=device)
            active[[i for m in groups.values() for i in m]] = True
        opt.step(active)
    sums_cpu = {k: v.cpu() for k, v in sums.items()}
    results = []
    for i, (ctx, plan) in enumerate(zip(ctxs, plans)):
        weights = {k: params[k][i].detach() for k in pnames if k in state_keys}
        weights.update({k: buffers[k][i] for k in bnames if k in state_keys})
        plan.model.load_state_dict(weights)
        steps = int(counts[i])
        results.append(plan.finish(plan.model, step_means({k: v[i] for k, v in sums_cpu.items()}, steps)))
    return results


def vectorize_enabled(setting: Any, device: torch.device, algo_cls: type) -> bool:
    """Whether a worker on ``device`` trains ``algo_cls``'s clients batched. ``runtime.vectorize``: true/false
    as said; ``auto`` vectorises on CUDA devices only (on a CPU batching clients measured slower than one at
    a time, see benchmarks/overhead.py). Never for a method without :meth:`Algorithm.local_training`, nor
    for one whose ``client_update`` is overridden below it (a subclass changing the update would be
    bypassed: it runs sequentially)."""
    if not (device.type == "cuda" if setting == "auto" else bool(setting)):
        return False

    def owner(name: str) -> type:
        return next(c for c in algo_cls.__mro__ if name in vars(c))

    planned, update = owner("local_training"), owner("client_update")
    return planned is not Algorithm and issubclass(planned, update)
