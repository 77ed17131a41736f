"""Teacher ensembles on the server: one stacked forward per architecture (large models teacher by teacher on CUDA).

Every distillation method's server runs each uploaded client model as a teacher on the same images:
DaFKD's Eq. 7-8 (classifier outputs s_k(x_i) and discriminator scores f_k(x_i) of every local model on the
generated set), FedDF's mean of the teachers' logits, FedD3A's Eq. 7 (sum_k alpha_k softmax(h_k(x) / T)).
Run as a Python loop, that is K ``load_state_dict`` copies and K small forwards per data batch; on a GPU
the kernels of one small model leave the device mostly idle. Here the K uploads of one architecture are
stacked (``torch.func.stack_module_state`` semantics: every parameter and buffer gets a leading K axis)
and evaluated by one ``vmap`` of ``torch.func.functional_call`` over that axis, so a single-architecture
round is one forward per data chunk whatever K is. Heterogeneous uploads (FedD3A's clients of other
architectures) are grouped by module: one vmapped forward per architecture group, the outputs put back
in upload order.

Numbers: the same function as the loop, up to float rounding (vmap turns a convolution over K weight sets
into one grouped convolution, whose summation order may differ); ``tests/learning/test_ensemble.py``
compares the two for LeNet-5 and a BatchNorm ResNet.

BatchNorm: teachers are evaluated in eval mode, where BatchNorm normalises by its running statistics.
Those are buffers, stacked per teacher like the parameters, so every teacher uses its own statistics
(train-mode BatchNorm under vmap would also update running statistics in place, which vmap cannot do on
shared buffers; it is never needed here).

On CUDA (:data:`LOOP_DEVICES`) the teachers of a model whose forward is not small (an estimated
:data:`LOOP_FROM_ROW_BYTES` of activations per image or more, see Memory) run one by one instead, each on whole
evaluation batches (a functional call with its weights, no module loaded). Measured on an H200
(``benchmarks/speed/server_ensemble.py``, 1,024 images, second run): ResNet-11 (~600 KiB a row), 8 teachers 0.080 s
one by one against 0.117 s stacked (0.318 s with chunks grown to 4 GiB of activations), 32 teachers 0.33 s
against 0.67 s (1.36 s): vmapped, a convolution over K weight sets is a grouped convolution, which cuDNN runs far
below a plain one, and a thousand images make a teacher's own kernels large. LeNet-5 (~60 KiB a row) goes the
other way, 8 teachers 0.0065 s one by one against 0.0034 s stacked, 32 teachers 0.026 s against 0.0096 s: its
kernels are small and their launches are what costs.

Memory: the stacked activations of G teachers on a chunk of n images are those of one model on G x n
images. The chunk is sized so that G x n rows stay within ``batch_size`` (the caller's evaluation batch,
``federation.eval_batch_size``): no more activation memory than the loop's one model on one batch. On a
GPU (:data:`BUDGET_DEVICES`) larger kernels are what pays, so there the bound is raised to what
:data:`ACTIVATION_BUDGET_BYTES` allows for this model (an estimate from one single-image forward: 3x the
largest layer output, for the input, the output and a residual branch held at once), at most K x
``batch_size``. Not on a CPU: measured here (``benchmarks/speed/server_ensemble.py``, LeNet-5, 1 thread),
chunks beyond ~1,000 rows are slower, cache-bound (8 teachers on 1,000 images: 0.52 s in chunks of
1,024 rows, 1.06 s grown to the budget; ``benchmarks/README.md``).
Stacked weights are a copy of the uploads: groups hold at most :data:`STACKED_WEIGHTS_BYTES` of them
(at least one teacher).

No loop fallback is needed for the zoo: every model in ``fedray.models.MODEL_NAMES`` runs under vmap in
eval mode with outputs equal to the loop's up to rounding (checked when this module was written). A
module whose forward vmap cannot batch (data-dependent Python control flow, ``.item()``) raises here
rather than silently falling back. A group of one teacher skips vmap: a plain functional call, nothing
to stack, bit-identical to the loop.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedray.learning.weights import Weights

#: Activation memory one stacked forward may use beyond one evaluation batch of one model (an estimate),
#: on the device types of BUDGET_DEVICES.
ACTIVATION_BUDGET_BYTES = 512 * 2**20
#: Devices on which chunks grow to the activation budget (bigger kernels); elsewhere rows <= batch_size.
BUDGET_DEVICES: tuple[str, ...] = ("cuda",)
#: Devices on which a group's teachers run one by one on whole batches rather than vmapped (see above).
LOOP_DEVICES: tuple[str, ...] = ("cuda",)
#: On LOOP_DEVICES, the estimated activation bytes per image (row_bytes) from which teachers run one by one.
LOOP_FROM_ROW_BYTES = 256 * 2**10
#: Stacked copies of the teachers' weights held at once per architecture group.
STACKED_WEIGHTS_BYTES = 1 * 2**30


def _device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _leaves(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    return []


@torch.no_grad()
def row_bytes(module: nn.Module, sample: Tensor) -> int:
    """Estimated activation bytes per input row of ``module``'s forward: 3 x its largest submodule output
    on ``sample`` (one row), for the input, the output and a residual branch alive at once."""
    largest = [sample[:1].numel() * sample.element_size()]

    def hook(_m, _inp, out):
        largest[0] = max([largest[0]] + [t.numel() * t.element_size() for t in _leaves(out)])

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        module(sample[:1])
    finally:
        for h in handles:
            h.remove()
    return 3 * largest[0]


def _weights_bytes(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def _stack(weights: Sequence[Weights], device: torch.device) -> Weights:
    """One tensor per state-dict key with a leading teacher axis (as ``torch.func.stack_module_state``
    builds from modules; here from the uploaded state dicts, without building K modules)."""
    keys = weights[0].keys()
    for w in weights[1:]:
        if w.keys() != keys:
            raise ValueError("teachers of one module must upload the same state-dict keys")
    return {k: torch.stack([w[k] for w in weights]).to(device) for k in keys}


@torch.no_grad()
def _group_outputs(module: nn.Module, weights: Sequence[Weights], x: Tensor, batch_size: int,
                   prepare: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Outputs of one module under each of ``weights`` on all of ``x``: a list (one per output of the
    module's forward) of (G, N, ...) tensors."""
    module.eval()
    dev = _device(module)
    n = len(x)
    rows, one_by_one = batch_size, len(weights) == 1
    if not one_by_one and dev.type in BUDGET_DEVICES + LOOP_DEVICES:
        per_row = row_bytes(module, prepare(x[:1]))
        one_by_one = dev.type in LOOP_DEVICES and per_row >= LOOP_FROM_ROW_BYTES
        if dev.type in BUDGET_DEVICES:
            rows = max(batch_size, min(len(weights) * batch_size, ACTIVATION_BUDGET_BYTES // max(per_row, 1)))
    if one_by_one:  # plain functional calls on whole batches, bit-identical to the loop
        per_teacher = []
        for weights_k in weights:
            w = {k: v.to(dev) for k, v in weights_k.items()}
            chunks = [_leaves(functional_call(module, w, (prepare(x[i : i + batch_size]),)))
                      for i in range(0, n, batch_size)]
            per_teacher.append([torch.cat([c[j] for c in chunks]) for j in range(len(chunks[0]))])
        return [torch.stack([t[j] for t in per_teacher]) for j in range(len(per_teacher[0]))]
    per_group = max(1, STACKED_WEIGHTS_BYTES // max(_weights_bytes(weights[0]), 1))
    call = vmap(lambda w, xb: tuple(_leaves(functional_call(module, w, (xb,)))), in_dims=(0, None))
    parts: list[list[Tensor]] = []  # per sub-group of teachers: one (g, N, ...) tensor per output
    for g0 in range(0, len(weights), per_group):
        stacked = _stack(weights[g0 : g0 + per_group], dev)
        g = next(iter(stacked.values())).shape[0]
        chunk = max(1, rows // g)
        outs = [call(stacked, prepare(x[i : i + chunk])) for i in range(0, n, chunk)]
        parts.append([torch.cat([o[j] for o in outs], dim=1) for j in range(len(outs[0]))])
        del stacked
    return [torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))]


def stacked_outputs(teachers: Iterable[tuple[nn.Module, Weights]], x: Tensor, batch_size: int,
                    prepare: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """Every teacher's outputs on ``x``, in eval mode: a list with one (K, N, ...) tensor per output of
    the modules' ``forward`` (one for a classifier's logits), row k = teacher k in the given order.

    A teacher is a module and the weights (state dict) it would be loaded with; teachers sharing a module
    (one architecture) are evaluated together by one vmapped forward per chunk of ``x``. The modules'
    own weights are not touched. ``prepare`` maps a chunk of ``x`` to the modules' input (e.g. uint8
    images to normalised floats); ``batch_size``: one model's evaluation batch (see the module docstring).
    """
    prepare = prepare or (lambda t: t)
    teachers = list(teachers)
    if not teachers:
        raise ValueError("no teachers")
    groups: dict[int, tuple[nn.Module, list[int]]] = {}
    for k, (module, _) in enumerate(teachers):  # one group per module object, i.e. per architecture
        groups.setdefault(id(module), (module, []))[1].append(k)
    result: list[Tensor] | None = None
    for module, idx in groups.values():
        outs = _group_outputs(module, [teachers[k][1] for k in idx], x, batch_size, prepare)
        if result is None:
            result = [o.new_empty((len(teachers), *o.shape[1:])) for o in outs]
        index = torch.tensor(idx, device=outs[0].device)
        for r, o in zip(result, outs):
            r[index] = o
    assert result is not None
    return result


def loop_outputs(teachers: Iterable[tuple[nn.Module, Weights]], x: Tensor, batch_size: int,
                 prepare: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """The reference :func:`stacked_outputs` replaces: load each teacher's weights, run it over ``x`` in
    batches. Kept for the equivalence tests and ``benchmarks/speed/server_ensemble.py``; it leaves the last
    teacher's weights in its module."""
    prepare = prepare or (lambda t: t)
    per_teacher = []
    with torch.no_grad():
        for module, weights in teachers:
            module.load_state_dict(weights)
            module.eval()
            chunks = [_leaves(module(prepare(x[i : i + batch_size]))) for i in range(0, len(x), batch_size)]
            per_teacher.append([torch.cat([c[j] for c in chunks]) for j in range(len(chunks[0]))])
    return [torch.stack([t[j] for t in per_teacher]) for j in range(len(per_teacher[0]))]
