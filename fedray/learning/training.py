"""A client's supervised local training, described as data rather than run inside ``client_update``.

Most methods' local update is "start from these weights, take ``ctx.num_local_steps()`` optimizer steps
of this loss on the client's batches, then build the upload from the trained model". A method's
``client_update`` says so by returning a :class:`LocalTraining` (or, for several modules and updates per step, a
:class:`StepwiseTraining`) instead of a finished :class:`ClientResult`, and the runtime chooses how to run it: one
client at a time (:func:`run_update`), or all of a worker's clients of the round in lockstep as one batched
computation (``fedray.vectorized``, ``runtime.vectorize``). The method does not change between the two: its local
training is a step function, and like FedJAX's ``for_each_client`` backends, how clients run is the runtime's choice.

The contract a :class:`LocalTraining` keeps so that batching it is exact:

- ``loss(model, x, y)`` depends on the client only through the model's weights and the batch: anything
  else it reads (the received global model, a teacher, teacher logits) is the same for every client of
  the round that gives the same ``group``. The runtime batches clients of one ``(model, group)`` and calls
  the first client's ``loss`` for all of them.
- ``loss`` is traceable by ``torch.func.vmap``: no ``.item()``/``float()``/``bool()`` of a tensor, no
  data-dependent shapes (mask, don't index). It returns the loss, or ``(loss, {"train/name": tensor})``
  for further per-step figures, averaged over the client's steps into its metrics.
- ``paddable``: every term of the loss that reads the batch averages over its rows not labelled
  :data:`IGNORE_LABEL` only, as ``F.cross_entropy(model(x), y)``'s default mean does (FedGKD's distillation
  term masks its own mean; other terms may read the model, not the batch).
  Then the runtime may pad a short batch with rows labelled :data:`IGNORE_LABEL` and batch it with the full
  ones, BatchNorm normalising by the other rows (:func:`~fedray.models.base.batch_rows`): exact up to rounding.
- ``client_inputs``: the client's own tensors its loss reads (client state, e.g. SCAFFOLD's correction
  c - c_i), by name. The loss is then ``loss(model, x, y, inputs)`` with this client's tensors as ``inputs``: the
  vectorised runtime stacks every client's once per round and hands each its own slice under ``vmap``, so the loss
  stays the same function for every client. Nothing else it reads may differ between clients.
- ``finish(model, trained)`` is called with ``model`` holding the client's trained weights and buffers and
  ``trained`` (:class:`Trained`) the figures' sums over the client's steps (``trained.means()``: their means, what
  a ``ClientResult``'s metrics usually are), its steps and its optimizer's final state; it builds the
  :class:`ClientResult` (upload, new client state) and may run the model (e.g. FedCD's logits on the shared batch).
  Both plans' ``finish`` take the same two arguments. A ``finish`` marked :func:`weights_only` reads the model only through
  ``model.state_dict()`` (``clone_weights``): the batched runner may then give it the client's weights on the
  host without loading them into the module.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedray.learning import optim
from fedray.learning.boundary import ClientContext, ClientResult
from fedray.learning.weights import Weights
from fedray.data.federated import ClientBatches

IGNORE_LABEL = -100  # F.cross_entropy's default ignore_index: a padded row's label
#: The key of a :class:`StepwiseTraining` step's inputs under which its ``client_inputs`` reach every loss
CLIENT_INPUTS = "client"
#: The key of a step's inputs that, under DP-SGD's per-example calls, holds the batch's size (an int; absent otherwise)
EXAMPLES = "examples"
LossOut = torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass
class Trained:
    """What a plan's ``finish`` is told of the client's training beside its trained model(s): the sums over its
    steps of every figure its losses returned (a :class:`LocalTraining`'s ``train/loss`` too), the steps it took,
    and the state its optimizer ended with, by parameter name as :attr:`StepwiseTraining.optimizer_state` (empty
    for a :class:`LocalTraining`, whose optimizer starts afresh each round)."""

    sums: dict[str, float]
    steps: int
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def means(self) -> dict[str, float]:
        """Each figure's mean over the steps (``{"train/loss": 0.0}`` when the client took none)."""
        return step_means(self.sums, self.steps)


def row_mean(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``values`` (one per row) over the rows where ``rows`` (bool) holds, e.g. a padded batch's real
    rows: their sum divided by their count (at least 1; on all rows, the plain mean's arithmetic). None: every row."""
    if rows is None:
        return values.mean()
    weights = rows.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp_min(1.0)


@dataclass
class LocalTraining:
    """One client's local supervised training: what the runtime needs to run it alone or batched."""

    model: torch.nn.Module  # the worker's module of this client's architecture; weights loaded from ``start``
    start: Weights  # the state dict training starts from (parameters and buffers)
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], LossOut]
    finish: Callable[[torch.nn.Module, "Trained"], ClientResult]
    group: Hashable = None  # clients of a round with equal (model, group) share ``loss`` and may be batched
    paddable: bool = False  # every term reading the batch averages over its rows not labelled IGNORE_LABEL
    #: this client's own tensors, by name, handed to ``loss`` as its fourth argument (module docstring)
    client_inputs: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class OptimSpec:
    """One parameter group's optimizer: ``torch.optim.SGD`` (momentum, weight decay) or ``Adam`` (L2 weight
    decay, ``betas``, eps 1e-8)."""

    kind: str  # "sgd" | "adam"
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    @classmethod
    def of(cls, fed: Any, lr: float | None = None) -> "OptimSpec":
        """``federation.*``'s optimizer (:func:`make_optimizer`), optionally another lr."""
        return cls(fed.optimizer, fed.lr if lr is None else lr, fed.momentum if fed.optimizer == "sgd" else 0.0,
                   fed.weight_decay)


@dataclass
class Update:
    """One optimizer update inside a local step: ``loss(modules, inputs, flags)`` moves the parameters of the
    modules named in ``groups`` (each with its optimizer settings); the other modules' parameters stay as they
    are. ``trains(flags)``: the groups this step's loss reaches (default: all), so that an unused module is
    skipped as ``torch.optim`` skips a parameter without a gradient.

    ``reads_examples``: the loss reads the client's examples (the ``x`` and ``y`` inputs). Under sample-level DP
    (DP-SGD, :mod:`fedray.privacy.dpsgd`) such an update's gradient is the clipped and noised sum of its examples'
    own gradients: the runtime calls the loss once per example, ``x`` and ``y`` that example alone and
    ``inputs[EXAMPLES]`` the batch's size (the other inputs as they are), so the loss must be the mean over its
    examples of the loss on each alone (a row mean of per-example terms plus terms of the other inputs; a count it
    pairs with the batch's reads ``EXAMPLES``). False (a generator's step against the trained modules): it learns
    from the examples only through what DP-SGD released, and runs as usual. ``paired``: the inputs whose rows pair
    with the batch's examples, row i with example i (FedGen's generated features of each example's label): a
    per-example call gets example i's row of each."""

    loss: Callable[[torch.nn.ModuleDict, dict[str, torch.Tensor], tuple], LossOut]
    groups: dict[str, OptimSpec]
    trains: Callable[[tuple], set[str]] | None = None
    reads_examples: bool = True
    paired: tuple[str, ...] = ()


@dataclass
class StepwiseTraining:
    """A local training of several modules whose step is a sequence of :class:`Update` s with per-step inputs
    (DaFKD: classifier and discriminator, then generator, on the batch and seeded noise). The runtime
    batches clients with equal ``(modules, group)`` under ``runtime.vectorize``; the method's own
    ``client_update`` is the sequential reference.

    ``inputs(step)`` is called for steps 0, 1, ... in order (it may draw from the client's generators) and
    returns the step's tensors and its flags: ``flags[u]`` says whether update ``u`` runs; further entries are
    the method's own (static: clients are batched by equal flags, and every loss sees them).
    ``finish(modules, trained)`` gets the trained modules and :class:`Trained`: the client's sums over its steps of
    every auxiliary figure of the updates that ran, its steps, and the optimizer state the training ended with, in
    the form of ``optimizer_state`` (below): :class:`LocalTraining`'s ``finish`` signature.

    ``batches``: when set, the ``x`` and ``y`` inputs of step ``s`` are the client's ``s``-th batch, which the
    runtime gathers for all clients of the step at once; ``inputs(step)`` then gives the other inputs only.
    ``paddable``: the losses count only a batch's rows not labelled :data:`IGNORE_LABEL` (a row-mean cross-entropy
    as :class:`LocalTraining`'s, or masks of their own) and run the modules on a padded batch inside
    :func:`~fedray.models.base.batch_rows` of its real rows (BatchNorm); the runtime may then pad a short batch, and
    zero-pad the other inputs along their first dimension to the step's longest, the loss counting the rows it drew
    (DaFKD's generated samples).

    ``optimizer_state`` continues an optimizer of an earlier round (FedKF's generator keeps its Adam moments):
    by parameter name (``"<module>.<parameter>"``), ``{"step": n, "exp_avg": m, "exp_avg_sq": v}`` (Adam) or
    ``{"step": n, "momentum_buffer": b}`` (SGD); absent parameters start fresh, as a new ``torch.optim`` would.

    ``client_inputs``: this client's own tensors (client state the losses read), by name: every loss finds them as
    ``inputs[CLIENT_INPUTS]``, the client's own under ``vmap``, stacked once per round by the runtime (as
    :class:`LocalTraining`'s).

    ``alone``: the method's own run of this client by itself, the sequential reference the batched run is tested
    against (DaFKD's and FedKF's hand-written loops); :func:`run_update` calls it when the runtime trains the
    client alone. None: the runtime runs the plan's steps for this client alone.
    """

    modules: torch.nn.ModuleDict  # the worker's modules, by name; weights loaded from ``start``
    start: dict[str, Weights]
    updates: list[Update]
    steps: int
    inputs: Callable[[int], tuple[dict[str, torch.Tensor], tuple[bool, ...]]]
    finish: Callable[[torch.nn.ModuleDict, Trained], ClientResult]
    group: Hashable = None
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    batches: ClientBatches | None = None
    paddable: bool = False
    client_inputs: dict[str, torch.Tensor] | None = None
    alone: Callable[[], ClientResult] | None = None


#: What a method's ``client_update`` returns: the finished result, or a training plan the runtime runs.
ClientUpdate = ClientResult | LocalTraining | StepwiseTraining


def weights_only(finish: Callable) -> Callable:
    """Marks ``finish`` (a :class:`LocalTraining`'s or :class:`StepwiseTraining`'s) as reading its model (modules)
    only through ``state_dict()``, as ``clone_weights`` does. The batched runner then copies all its clients' trained weights to the host at once and
    hands ``finish`` a stand-in whose ``state_dict()`` is the client's share of that copy, instead of loading each
    client's weights into the module and copying them back tensor by tensor (on a GPU, a kernel launch and a
    synchronising copy per tensor and client). A function that calls a marked ``finish`` is not marked itself."""
    finish.weights_only = True  # type: ignore[attr-defined]
    return finish


def is_weights_only(finish: Callable) -> bool:
    return bool(getattr(finish, "weights_only", False))


def make_optimizer(params, fed: Any) -> optim.SGD | optim.Adam:
    """The local optimizer of ``federation.*``: SGD (momentum, weight decay) or Adam (weight decay)."""
    if fed.optimizer == "adam":
        return optim.Adam(params, lr=fed.lr, weight_decay=fed.weight_decay)
    return optim.SGD(params, lr=fed.lr, momentum=fed.momentum, weight_decay=fed.weight_decay)


def module_dict(owner: Any, **modules: torch.nn.Module) -> torch.nn.ModuleDict:
    """``modules`` by name in one container, kept on ``owner`` (a method's instance in a worker): the runtime
    batches clients whose :class:`StepwiseTraining` share the container's modules, so every client of the
    worker must get the same one, rebuilt only when the worker's modules change."""
    cached = getattr(owner, "_modules_by_name", None)
    if cached is None or any(name not in cached or cached[name] is not m for name, m in modules.items()):
        cached = owner._modules_by_name = torch.nn.ModuleDict(modules)
    return cached


def split_loss(out: LossOut) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return out if isinstance(out, tuple) else (out, {})


def run_local_training(ctx: ClientContext, plan: LocalTraining) -> ClientResult:
    """The sequential runner: ``ctx.batches()`` steps of ``plan.loss`` with ``federation.*``'s optimizer
    then ``plan.finish``, told the sums of ``train/loss`` and the loss's other figures over the steps."""
    model = plan.model
    model.load_state_dict(plan.start)
    model.train()
    opt = make_optimizer(model.parameters(), ctx.fed)
    sums: dict[str, torch.Tensor] = {}
    steps = 0
    own = () if plan.client_inputs is None else (plan.client_inputs,)
    for x, y in ctx.batches():
        opt.zero_grad()
        loss, aux = split_loss(plan.loss(model, x, y, *own))
        loss.backward()
        opt.step()
        for key, value in {"train/loss": loss, **aux}.items():
            sums[key] = sums.get(key, 0.0) + value.detach()
        steps += 1
    return plan.finish(model, Trained({key: float(total) for key, total in sums.items()}, steps))


def run_update(ctx: ClientContext, update: ClientUpdate) -> ClientResult:
    """One client's update run by itself: a finished result as it is, a :class:`LocalTraining` by
    :func:`run_local_training`, a :class:`StepwiseTraining` by its ``alone`` (the runtime runs one without it through
    the lockstep engine, for this client alone)."""
    if isinstance(update, ClientResult):
        return update
    if isinstance(update, LocalTraining):
        return run_local_training(ctx, update)
    if update.alone is None:
        raise ValueError("this StepwiseTraining has no 'alone' run: run it through the runtime")
    return update.alone()


def step_means(sums: dict[str, Any], steps: int) -> dict[str, float]:
    """Per-step sums of the training figures -> their means (one device sync, at the end)."""
    return {key: float(total) / max(steps, 1) for key, total in sums.items()} if steps else {"train/loss": 0.0}
