"""Vectorised clients: a worker trains its clients of a round in lockstep, as one batched computation.

Each client's update is a :class:`~fedray.learning.training.LocalTraining` (start weights, a loss,
``ctx.batches()``) or a :class:`~fedray.learning.training.StepwiseTraining` (several updates on several
modules per step: DaFKD, FedKF); clients that share modules and losses are trained together:

- parameters, buffers and optimizer state are stacked along a leading client axis; each update of a step
  is ``vmap(functional_call(modules, ...))`` over the clients' inputs, one ``backward`` of the summed
  losses (the clients' losses are independent, so each client's rows of the stacked gradient are its own
  gradient), and an element-wise optimizer step on the stacked tensors that follows ``torch.optim``'s
  SGD (momentum, weight decay) and Adam (L2 weight decay, betas) step for step;
- BatchNorm running statistics are buffers of the stack: every client keeps its own;
- a client with fewer steps (``local_epochs`` over less data) is done early, never padded with extra updates:
  the round runs in phases, each a lockstep of the clients still training (``fedray.vectorized.phases``); a module a
  client's loss did not reach is not stepped for it (its rows masked in that step);
- a step's batches of all clients are one gather from the clients' data, concatenated once a round
  (:class:`~fedray.vectorized.round_batches.RoundBatches`); a client whose batch of a step is shorter (a pass ending on a short batch) has it
  padded with rows its loss ignores when the loss allows it (``paddable``), else it runs as its own vmap group
  in that step, as does a client whose step runs other updates. Under BatchNorm a padded row would change the
  batch statistics: such a round is padded only when more than :data:`PAD_BATCHNORM_FROM` of its steps would
  split (many clients at alpha = 0.1), and its BatchNorm layers then normalise by the real rows alone
  (:func:`~fedray.models.base.batch_rows`); otherwise its short batches run as groups of their own.

So the numbers are those of the sequential runner up to float rounding. On a GPU one batched kernel
replaces K small ones (kernel launches, not arithmetic, set the pace of small models), and the usual step is
replayed as a CUDA graph (:class:`StepGraph`, ``runtime.cuda_graphs``); on a CPU it does not pay
(``runtime.vectorize=auto`` keeps CPU runs sequential).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.func import functional_call, vmap

from fedray.learning.boundary import ClientContext, ClientResult
from fedray.learning.training import (CLIENT_INPUTS, IGNORE_LABEL, LocalTraining, OptimSpec, StepwiseTraining, Trained,
                                       Update, is_weights_only, run_update, split_loss, weights_only)
from fedray.data.federated import to_device
from fedray.models.base import batch_rows, row_masked_batchnorm
from fedray.vectorized.phases import Tally, in_phases, reported
from fedray.vectorized.round_batches import RoundBatches, pad_host_inputs
from fedray.vectorized.stacked_optimizer import StackedOptimizer
from fedray.vectorized.step_graph import StepGraph
from fedray.privacy.dpsgd import DPSGD, per_example_gradients

#: A round of a BatchNorm model and a ``paddable`` loss is padded, its BatchNorm layers masked to the real rows, when
#: more than this share of its steps would split by batch length: then one vmapped call (and one plain CUDA graph) a
#: step replaces several; with fewer, the masking's extra work in every step would cost more than the splits.
PAD_BATCHNORM_FROM = 0.5


class _LossModule(torch.nn.Module):
    """An update's ``loss(modules, inputs)`` as a module, so ``functional_call`` swaps the modules' parameters
    and buffers for one client's slice everywhere the loss looks: ``model(x)``, ``model.features``,
    ``model.parameters()`` (FedProx's proximal term)."""

    def __init__(self, modules: torch.nn.ModuleDict, loss):
        super().__init__()
        self.modules_ = modules
        self.loss = loss
        self.flags: tuple = ()  # the batched group's flags, static for one vmapped call

    def forward(self, inputs: dict[str, torch.Tensor]):
        return self.loss(self.modules_, inputs, self.flags)


def as_stepwise(ctx: ClientContext, plan: LocalTraining) -> StepwiseTraining:
    """A :class:`LocalTraining` as the one-update special case: module ``model``, ``federation.*``'s optimizer,
    the client's batches as inputs; its ``finish`` gets the model (the one ``finish`` signature of both plans)."""

    def loss(modules: torch.nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):
        # the model reads the batch only as model(x) (paddable): its padded rows, if any, are those labelled so
        own = () if plan.client_inputs is None else (inp[CLIENT_INPUTS],)
        with batch_rows(inp["y"] != IGNORE_LABEL):
            out, aux = split_loss(plan.loss(modules["model"], inp["x"], inp["y"], *own))
        return out, {"train/loss": out, **aux}

    def finish(modules: torch.nn.ModuleDict, trained: Trained) -> ClientResult:
        return plan.finish(modules["model"], trained)

    if is_weights_only(plan.finish):
        weights_only(finish)
    return StepwiseTraining(modules=torch.nn.ModuleDict({"model": plan.model}), start={"model": plan.start},
                            updates=[Update(loss=loss, groups={"model": OptimSpec.of(ctx.fed)})],
                            steps=ctx.num_local_steps(), inputs=lambda step: ({}, (True,)), finish=finish,
                            group=plan.group, batches=ctx.batch_plan(), paddable=plan.paddable,
                            client_inputs=plan.client_inputs)


def _lockstep(plans: list[StepwiseTraining]) -> Iterator[list[tuple[dict, tuple[bool, ...]] | None]]:
    """Step by step, each client's inputs and update flags (None once it has taken all its steps)."""
    for s in range(max(p.steps for p in plans)):
        yield [p.inputs(s) if s < p.steps else None for p in plans]


def run_alone(ctx: ClientContext, update: Any, cuda_graphs: bool = False, dp: DPSGD | None = None) -> ClientResult:
    """One client's update run by itself: a :class:`StepwiseTraining` without a run of its own goes through the
    lockstep engine for this client alone, anything else through :func:`~fedray.learning.training.run_update`.
    With ``dp`` (DP-SGD) every training plan goes through the engine, which alone computes its gradients."""
    if dp is not None and not isinstance(update, ClientResult):
        return train_vectorized([ctx], [update], pad=False, dp=dp)[0]
    if isinstance(update, StepwiseTraining) and update.alone is None:
        return train_vectorized([ctx], [update], pad=False, cuda_graphs=cuda_graphs)[0]
    return run_update(ctx, update)


def train_vectorized(ctxs: list[ClientContext], plans: list[LocalTraining | StepwiseTraining],
                     pad: bool = True, cuda_graphs: bool = False, dp: DPSGD | None = None) -> list[ClientResult]:
    """Run ``plans`` (one per client, all of one ``(modules, group)`` and one round) in lockstep; each client's
    ``finish`` is called in order with the modules holding that client's trained weights (a ``weights_only`` one
    with a stand-in holding them on the host: all clients' weights leave the device in one copy). ``pad``: short batches
    of ``paddable`` plans are padded into the step's one batched call (``runtime.vectorize_pad``); ``cuda_graphs``:
    the usual step is replayed as a CUDA graph where :class:`StepGraph` allows (``runtime.cuda_graphs``).
    Clients with fewer steps than others train in phases (:func:`~fedray.vectorized.phases.in_phases`). ``dp``:
    DP-SGD's gradient for every update that reads the examples (:mod:`fedray.privacy.dpsgd`; no padding, no graphs).
    """
    # a LocalTraining's finish takes no optimizer state: none is read out for it
    keeps_optimizer = [not isinstance(p, LocalTraining) for p in plans]
    plans = [as_stepwise(c, p) if isinstance(p, LocalTraining) else p for c, p in zip(ctxs, plans)]
    if dp is not None:  # a padded row would be an example; a graph would replay one client's noise
        pad = cuda_graphs = False
    ends = sorted({p.steps for p in plans})
    if len(ends) > 1 and ends[0] > 0:
        return in_phases(ctxs, plans, keeps_optimizer, ends,
                         lambda c, p, k: _lockstep_round(c, p, k, pad, cuda_graphs, dp))
    results, tally = _lockstep_round(ctxs, plans, keeps_optimizer, pad, cuda_graphs, dp)
    return reported(results, [tally])


def _lockstep_round(ctxs: list[ClientContext], plans: list[StepwiseTraining], keeps_optimizer: list[bool], pad: bool,
                    cuda_graphs: bool, dp: DPSGD | None = None) -> tuple[list[Any], Tally]:
    """One lockstep of ``plans`` from their starts (see :func:`train_vectorized`): the clients' ``finish`` results,
    and (vmapped calls, steps, steps replayed or None) for :func:`~fedray.vectorized.phases.reported`."""
    modules, device, n = plans[0].modules, ctxs[0].device, len(plans)
    for name, weights in plans[0].start.items():  # non-persistent buffers, if any, come from here
        modules[name].load_state_dict(weights)
    modules.train()
    state_keys = list(modules.state_dict())  # what a client's trained weights are, in state_dict order

    def stack(key: str, current: torch.Tensor) -> torch.Tensor:
        name, sub = key.split(".", 1)
        starts = [p.start[name][sub] if sub in p.start[name] else current for p in plans]
        if all(t is starts[0] for t in starts):  # one start for all (the round's global model): copied once
            return starts[0].detach().to(device).expand(n, *starts[0].shape).clone()
        return torch.stack([t.detach().to(device) for t in starts])

    params = {k: stack(k, v).requires_grad_(True) for k, v in modules.named_parameters()}
    buffers = {k: stack(k, v) for k, v in modules.named_buffers()}
    updates = plans[0].updates
    moved = [{k: v for k, v in params.items() if k.split(".", 1)[0] in u.groups} for u in updates]
    opts = [StackedOptimizer(mv, {k: u.groups[k.split(".", 1)[0]] for k in mv}) for u, mv in zip(updates, moved)]
    for opt in opts:
        opt.load([p.optimizer_state for p in plans])
    own = _stacked_client_inputs(plans, device)  # each client's own tensors, stacked once for the round
    wrappers = [_LossModule(modules, u.loss) for u in updates]
    calls = [vmap(_client_call(w), randomness="different") for w in wrappers]
    private = [dp is not None and u.reads_examples for u in updates]
    if any(private):
        dp.check(modules, [u for u, p in zip(updates, private) if p])
    examples_calls = [vmap(per_example_gradients(w, u.paired), randomness="different") if p else None
                      for w, u, p in zip(wrappers, updates, private)]
    sums: dict[str, torch.Tensor] = {}
    group_count = step_count = client_steps = 0
    assert len({p.batches is None for p in plans}) == 1, "batched clients give their batches all alike"
    graphs = cuda_graphs and StepGraph.possible(device)
    paddable, couples = pad and plans[0].paddable, _couples_rows(modules)
    batched = RoundBatches(plans, device, paddable and not couples, StepGraph.MASKED_FROM if graphs else None,
                            PAD_BATCHNORM_FROM if paddable and couples else None) if plans[0].batches is not None else None
    # padded rows under BatchNorm: its layers normalise by the rows the losses mark real (batch_rows)
    masked_rows = row_masked_batchnorm(modules) if batched is not None and batched.padded and couples else None

    def sum_of(key: str) -> torch.Tensor:
        """Figure ``key``'s per-client sum over the steps (made once, not a zeros kernel every step)."""
        if key not in sums:
            sums[key] = torch.zeros(n, dtype=torch.float64, device=device)
        return sums[key]

    def call_everyone(u: int, inp: dict[str, torch.Tensor]) -> torch.Tensor:
        """Update ``u``'s losses of every client (the usual step: no client index needed anywhere), its figures
        added to the sums."""
        losses, aux = calls[u](params, buffers, inp)
        for key, value in aux.items():
            sum_of(key).add_(value.detach())
        return losses

    def eager_step(s: int, groups: dict[tuple, list[int]], host: dict[tuple, dict[str, torch.Tensor]]) -> None:
        """One lockstep step, each update as one vmapped call per group of clients (``groups``, their stacked host
        inputs ``host``); a group's inputs go to the device once, for all its updates."""
        on_device: dict[tuple, dict[str, torch.Tensor]] = {}
        for u, (call, opt) in enumerate(zip(calls, opts)):
            runs = [(group, members) for group, members in groups.items() if group[0][u]]
            if not runs:
                continue
            for p in params.values():
                p.grad = None
            everyone = len(runs) == 1 and len(runs[0][1]) == n
            losses_of_runs = []
            for group, members in runs:
                wrappers[u].flags = group[0]
                if group not in on_device:
                    on_device[group] = {k: to_device(v, device) for k, v in host[group].items()}
                    if batched is not None:
                        on_device[group].update(batched.inputs(s, members))
                inp = on_device[group]
                if private[u]:
                    private_step(u, members, inp)
                    continue
                if everyone:
                    losses = call_everyone(u, inp if own is None else {**inp, CLIENT_INPUTS: own})
                else:
                    index = to_device(torch.tensor(members), device)
                    if own is not None:
                        inp = {**inp, CLIENT_INPUTS: {k: v[index] for k, v in own.items()}}
                    sub_b = {k: v[index] for k, v in buffers.items()}
                    losses, aux = call({k: v[index] for k, v in params.items()}, sub_b, inp)
                    for k, v in sub_b.items():  # BatchNorm statistics updated in the gathered copy
                        buffers[k][index] = v
                    for key, value in aux.items():
                        sum_of(key).index_add_(0, index, value.detach().to(torch.float64))
                losses_of_runs.append(losses.sum())
            if losses_of_runs:
                total = losses_of_runs[0] if len(losses_of_runs) == 1 else torch.stack(losses_of_runs).sum()
                total.backward(inputs=list(moved[u].values()))
            active = None if everyone else _mask(n, [i for _, members in runs for i in members])
            per_key = None
            if updates[u].trains is not None:  # a module some clients' losses did not reach this step
                per_module = {name: _mask(n, [i for group, members in runs if name in updates[u].trains(group[0])
                                              for i in members]) for name in updates[u].groups}
                per_key = {k: per_module[k.split(".", 1)[0]] for k in moved[u]}
            opt.step(active, per_key)

    def private_step(u: int, members: list[int], inp: dict[str, torch.Tensor]) -> None:
        """DP-SGD's gradient of update ``u`` for ``members`` (one group: one batch length) into their rows of the
        parameters' ``.grad``: each example's gradient (the loss on it alone, ``examples_calls``), clipped, summed,
        noised from each client's own stream, over its denominator. The step's figures (and BatchNorm statistics)
        come from the usual batched call of the loss, without a gradient; an empty batch (Poisson) has none."""
        index = to_device(torch.tensor(members), device)
        if own is not None:
            inp = {**inp, CLIENT_INPUTS: {k: v[index] for k, v in own.items()}}
        sub_p = {k: v.detach()[index] for k, v in params.items()}
        sub_b = {k: v[index] for k, v in buffers.items()}
        mv = {k: sub_p.pop(k) for k in moved[u]}
        rows = inp["x"].shape[1]
        if rows:
            per = examples_calls[u](mv, sub_p, {k: v.clone() for k, v in sub_b.items()}, inp)
            with torch.no_grad():
                _, aux = calls[u]({**sub_p, **mv}, sub_b, inp)
            for k, v in sub_b.items():
                buffers[k][index] = v
            for key, value in aux.items():
                sum_of(key).index_add_(0, index, value.detach().to(torch.float64))
        else:
            per = {k: v.new_zeros(len(members), 0, *v.shape[1:]) for k, v in mv.items()}
        grads = dp.noised_mean(per, [ctxs[i].client_id for i in members], rows)
        for k, g in grads.items():
            if params[k].grad is None:
                params[k].grad = torch.zeros_like(params[k])
            params[k].grad[index] = g

    def graph_body(key: tuple, inp: dict[str, torch.Tensor]) -> None:
        """``eager_step`` of every client (one group, flags ``key[0]``) on the batches of ``inp["index"]`` and the
        host inputs in the rest of ``inp``: what :class:`StepGraph` captures; the optimizers' step counts are the
        graph's to keep. With ``inp["mask"]`` (a masked graph) the clients outside it end the step as they began."""
        flags = key[0]
        data = {**{k: v for k, v in inp.items() if k not in ("index", "mask")}, **batched.gather(inp["index"])}
        if own is not None:
            data[CLIENT_INPUTS] = own
        with graph.keeping(inp.get("mask"), [*params.values(), *buffers.values(), *sums.values()],
                           [o for o, f in zip(opts, flags) if f]):
            graph_updates(flags, data)

    def graph_updates(flags: tuple, data: dict[str, torch.Tensor]) -> None:
        for u in range(len(updates)):
            if not flags[u]:
                continue
            for p in params.values():  # so backward allocates the gradients in the graph, and a replay rewrites them
                p.grad = None
            wrappers[u].flags = flags
            losses = call_everyone(u, data)  # the sums exist: the warm-up steps made them
            losses.sum().backward(inputs=list(moved[u].values()))
            if updates[u].trains is not None:  # a module the update reached but does not train this step stays
                kept = updates[u].trains(flags)
                for k in moved[u]:
                    if k.split(".", 1)[0] not in kept:
                        params[k].grad = None
            opts[u].step_device()

    graph = StepGraph(device, graph_body, masked=bool(batched.full)) if graphs and batched is not None else None
    total_steps = max(p.steps for p in plans)
    with graph.running() if graph is not None else contextlib.nullcontext(), masked_rows or contextlib.nullcontext():
        for s, step_inputs in enumerate(_lockstep(plans)):
            if batched is not None and batched.padded:
                step_inputs = pad_host_inputs(step_inputs)
            groups: dict[tuple, list[int]] = {}  # clients whose inputs have the same shapes and flags
            for i, item in enumerate(step_inputs):
                if item is not None:
                    inp, flags = item
                    shapes = tuple((k, tuple(v.shape)) for k, v in inp.items())
                    groups.setdefault((flags, shapes, batched.group_of(s, i) if batched else None), []).append(i)
            group_count, step_count = group_count + len(groups), step_count + 1
            client_steps += sum(map(len, groups.values()))
            # inputs drawn on the host (seeded noise) are stacked there: one copy to the device, not one a client
            host = {group: {k: torch.stack([step_inputs[i][0][k] for i in members]) for k in step_inputs[members[0]][0]}
                    for group, members in groups.items()}
            planned = graph.plan(groups, host, batched, s, n) if graph is not None else None
            if planned is not None:
                key, inp, rest, left_out = planned
                if graph.step(key, inp, [o for o, f in zip(opts, key[0]) if f], total_steps - s, left_out):
                    if rest:  # a masked replay: the clients it left out take their step eagerly
                        eager_step(s, rest, host)
                    continue
            eager_step(s, groups, host)
    sums_cpu = {k: v.cpu().tolist() for k, v in sums.items()}
    trained = {**params, **buffers}
    order = [k for k in state_keys if k in trained]
    host = _host_rows([trained[k] for k in order]) if any(is_weights_only(p.finish) for p in plans) else None
    results = []
    for i, plan in enumerate(plans):
        if host is not None and is_weights_only(plan.finish):
            model: Any = _HostWeights(dict(zip(order, host[i])))
        else:
            plan.modules.load_state_dict({k: trained[k][i].detach() for k in order})
            model = plan.modules
        figures = {k: v[i] for k, v in sums_cpu.items()}
        opt_state = {k: v for opt in opts for k, v in opt.client_state(i).items()} if keeps_optimizer[i] else {}
        results.append(plan.finish(model, Trained(figures, plan.steps, opt_state)))
    return results, (group_count, step_count, graph.replays if graph is not None else None, client_steps)


class _HostWeights:
    """What a :func:`~fedray.learning.training.weights_only` ``finish`` gets as its model: ``state_dict()`` is the
    client's trained weights on the host (views of the round's one copy; ``clone_weights`` copies them), and
    ``[name]`` the part of a module of a ``ModuleDict``."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self._weights = weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._weights)

    def __getitem__(self, name: str) -> "_HostWeights":
        prefix = name + "."
        return _HostWeights({k[len(prefix):]: v for k, v in self._weights.items() if k.startswith(prefix)})


def _host_rows(stacked: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per client, its row of each of the ``stacked`` tensors (client axis first), on the host: the rows of all
    tensors of a dtype are concatenated on the device and copied in one go, then cut into views, so K clients'
    weights cost a copy per dtype rather than one (a synchronising one on a GPU) per tensor and client."""
    n = stacked[0].shape[0]
    rows: list[list[Any]] = [[None] * len(stacked) for _ in range(n)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(stacked):
        by_dtype.setdefault(t.dtype, []).append(j)
    for members in by_dtype.values():
        flat = torch.cat([stacked[j].detach().reshape(n, -1) for j in members], dim=1).cpu()
        sizes = [stacked[j][0].numel() for j in members]
        for i in range(n):
            for j, part in zip(members, flat[i].split(sizes)):
                rows[i][j] = part.view(stacked[j].shape[1:])
    return rows


def _stacked_client_inputs(plans: list[StepwiseTraining], device: torch.device) -> dict[str, torch.Tensor] | None:
    """The plans' ``client_inputs`` stacked along a leading client axis on ``device`` (None when they have none)."""
    if plans[0].client_inputs is None:
        assert all(p.client_inputs is None for p in plans), "batched clients give client_inputs all alike"
        return None
    keys = plans[0].client_inputs.keys()
    assert all(p.client_inputs is not None and p.client_inputs.keys() == keys for p in plans), (
        "batched clients give client_inputs of the same names")
    return {k: torch.stack([to_device(p.client_inputs[k], device) for p in plans]) for k in keys}


def _couples_rows(modules: torch.nn.Module) -> bool:
    """Whether a batch's rows interact in ``modules``' training forward (BatchNorm's batch statistics): then a
    padded row would change the others' unless the layers are masked to the real rows (``PAD_BATCHNORM_FROM``)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in modules.modules())


def _mask(n: int, members: list[int]) -> torch.Tensor | None:
    """The clients ``members`` of ``n`` as a bool mask on the host; None when that is all of them."""
    if len(set(members)) == n:
        return None
    mask = torch.zeros(n, dtype=torch.bool)
    mask[members] = True
    return mask


def _client_call(wrapper: _LossModule):
    def one_client(p: dict, b: dict, inputs: dict):
        return split_loss(functional_call(wrapper, ({f"modules_.{k}": v for k, v in p.items()},
                                                    {f"modules_.{k}": v for k, v in b.items()}), (inputs,)))
    return one_client
