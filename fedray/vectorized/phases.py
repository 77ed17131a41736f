"""Vectorised clients done early (``local_epochs`` over unequal data): a round of ``fedray.vectorized.engine`` as
phases, each a lockstep of the clients still training, and the round's tally of how well its locksteps batched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from fedray.learning.boundary import ClientContext, ClientResult
from fedray.learning.training import StepwiseTraining, Trained, is_weights_only, weights_only

#: (vmapped calls, steps, steps replayed from a CUDA graph or None without one, clients' steps) of one lockstep
Tally = tuple[int, int, int | None, int]
Lockstep = Callable[[list[ClientContext], list[StepwiseTraining], list[bool]], tuple[list[Any], Tally]]


def in_phases(ctxs: list[ClientContext], plans: list[StepwiseTraining], keeps_optimizer: list[bool], ends: list[int],
              lockstep: Lockstep) -> list[ClientResult]:
    """Clients with fewer steps (``local_epochs`` over unequal data, as every paper budget has) done early: the round
    as phases, each a lockstep of the clients still training until the next of them is done (``ends``: the clients'
    step counts). A client's weights, buffers, optimizer state and figure sums pass from one phase to the next, and its
    ``finish`` is called at the end of its last phase with the figures summed over all of them. So every step of a
    phase is a step of all its clients (torch.optim's multi-tensor step, a CUDA graph's plain replay), where one
    lockstep would carry the finished clients' rows along, masked, in every later step (an element-wise optimizer
    step per parameter, no replays); the same numbers up to float rounding (fewer clients in a vmapped call).
    ``lockstep(ctxs, plans, keeps_optimizer)``: one lockstep of a phase's clients, as ``fedray.vectorized.engine``
    runs it (their ``finish`` results, and its tally for :func:`reported`)."""
    start = [p.start for p in plans]
    optimizer_state = [p.optimizer_state for p in plans]
    sums: list[dict[str, float]] = [{} for _ in plans]
    results: list[Any] = [None] * len(plans)
    tallies, begin = [], 0
    for end in ends:
        members = [i for i, p in enumerate(plans) if p.steps >= end]
        phase = [_phase(plans[i], begin, end, start[i], optimizer_state[i],
                        _final(plans[i], sums[i]) if plans[i].steps == end else _carry(i, start, optimizer_state, sums))
                 for i in members]
        out, tally = lockstep([ctxs[i] for i in members], phase,
                              [keeps_optimizer[i] or plans[i].steps > end for i in members])
        tallies.append(tally)
        for i, result in zip(members, out):
            if plans[i].steps == end:
                results[i] = result
        begin = end
    return reported(results, tallies)


def _phase(plan: StepwiseTraining, begin: int, end: int, start: dict, optimizer_state: dict,
           finish: Any) -> StepwiseTraining:
    """Steps ``begin`` to ``end`` of ``plan``, from ``start`` and ``optimizer_state``, ended by ``finish``."""
    return StepwiseTraining(modules=plan.modules, start=start, updates=plan.updates, steps=end - begin,
                            inputs=lambda step: plan.inputs(step + begin), finish=finish, group=plan.group,
                            optimizer_state=optimizer_state, paddable=plan.paddable, client_inputs=plan.client_inputs,
                            batches=None if plan.batches is None else replace(plan.batches,
                                                                              index=plan.batches.index[begin:end]))


def _carry(i: int, start: list, optimizer_state: list, sums: list[dict[str, float]]):
    """A phase's ``finish`` of client ``i`` when it trains on: its weights and optimizer state are where the next
    phase starts, its figures are added to its sums."""

    def finish(modules: torch.nn.ModuleDict, trained: Trained) -> None:
        start[i] = {name: {k: v.detach().clone() for k, v in m.state_dict().items()} for name, m in modules.items()}
        optimizer_state[i] = trained.optimizer_state
        _add(sums[i], trained.sums)
    return finish


def _final(plan: StepwiseTraining, sums: dict[str, float]):
    """The last phase's ``finish`` of ``plan``'s client: its own, with the figures summed over the phases."""

    def finish(modules: Any, trained: Trained) -> ClientResult:
        _add(sums, trained.sums)
        return plan.finish(modules, Trained(dict(sums), plan.steps, trained.optimizer_state))
    if is_weights_only(plan.finish):
        weights_only(finish)
    return finish


def _add(sums: dict[str, float], figures: dict[str, float]) -> None:
    for key, value in figures.items():
        sums[key] = sums.get(key, 0.0) + value


def reported(results: list[ClientResult], tallies: list[Tally]) -> list[ClientResult]:
    """``results`` with how well the lockstep batched, over the round's ``tallies`` (:data:`Tally` of each
    lockstep): ``vec/groups_per_step``, 1 when every step was one vmapped call per update (each short batch or
    differing flag splits a step into one more call); ``vec/clients_per_call``, the clients one vmapped call trained
    on average (1 when nothing was batched: a plan whose ``group`` differs per client, however its steps went); and
    on a GPU ``vec/graph_steps``, the share of steps replayed from a CUDA graph (benchmarks/speed/gpu.py reports
    them)."""
    steps = max(sum(t[1] for t in tallies), 1)
    calls = max(sum(t[0] for t in tallies), 1)
    replays = [t[2] for t in tallies if t[2] is not None]
    for result in results:
        result.metrics["vec/groups_per_step"] = sum(t[0] for t in tallies) / steps
        result.metrics["vec/clients_per_call"] = sum(t[3] for t in tallies) / calls
        if replays:
            result.metrics["vec/graph_steps"] = sum(replays) / steps
    return results
