"""The optimizer step of vectorised clients (``fedray.vectorized.engine``): ``torch.optim``'s SGD and Adam
applied to parameters stacked along a leading client axis, each client's rows moving as its own optimizer
would move them."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

from fedray.learning.optim import ADAM_EPS
from fedray.learning.training import OptimSpec
from fedray.data.federated import to_device


class StackedOptimizer:
    """Per-group :class:`OptimSpec` optimizers applied to stacked per-client tensors, with a per-client mask.

    The arithmetic is ``torch.optim.SGD``/``Adam``'s step, element-wise, so a client's rows evolve as its own
    optimizer would move them; masked rows (clients already done, or skipping this update in this step) do
    not move. When every client takes a step and all of them have taken equally many before (the usual
    step), the parameters of one setting are stepped by torch.optim's own functional SGD/Adam with
    ``foreach=True``: a few multi-tensor kernels for the whole model instead of several per parameter
    (kernel launches set the pace of a batched step on a GPU). Otherwise each parameter is stepped on its
    own, masked rows kept with ``torch.where``. Masks stay on the host: no step waits for the GPU.
    """

    def __init__(self, params: dict[str, torch.Tensor], specs: dict[str, OptimSpec]):
        self.params, self.specs = params, specs
        n = next(iter(params.values())).shape[0]
        # per parameter and client, as torch.optim keeps them: steps taken (Adam's bias correction, SGD's
        # first momentum step), momentum buffer or Adam's moments
        self.steps = {k: torch.zeros(n, dtype=torch.float64) for k in params}
        self.state: dict[str, list[torch.Tensor | None]] = {k: [None, None] for k in params}
        self.even = {k: True for k in params}  # whether every client has taken as many steps of k
        self.multi_tensor_steps = 0  # steps of a parameter group taken by the foreach path (for tests)
        self._stepped: dict[OptimSpec, list[str]] = {}  # what the last step_device stepped, by setting
        # Adam's step counts of the multi-tensor path on the parameters' device, one scalar per parameter as
        # torch.optim keeps them, stepped by torch's own Adam (capturable on CUDA: its bias correction read on the
        # device, so a CUDA graph of the step replays it); made from ``steps`` when missing
        self.device_steps: dict[str, torch.Tensor] = {}
        self._device_count: dict[str, float] = {}  # what each of device_steps holds, known on the host

    @torch.no_grad()
    def step(self, active: torch.Tensor | None, per_key: dict[str, torch.Tensor | None] | None = None) -> None:
        """One step for the clients where ``active`` (bool CPU tensor, (K,)) is True (None: all of them);
        ``per_key`` narrows it for some parameters (a module a client's loss did not use this step)."""
        together: dict[OptimSpec, list[str]] = {}
        on_device: dict[int, torch.Tensor] = {}
        for key, p in self.params.items():
            if p.grad is None:  # a parameter the loss never used: torch.optim skips it too
                continue
            mask = (per_key or {}).get(key, active)
            if mask is None and self.even[key]:
                together.setdefault(self.specs[key], []).append(key)
                continue
            if mask is not None and id(mask) not in on_device:
                on_device[id(mask)] = to_device(mask, p.device)
            self._step_one(key, p, None if mask is None else on_device[id(mask)], mask)
        for spec, keys in together.items():
            self._step_together(spec, keys)
            self._count_together(keys)

    def uniform(self) -> bool:
        """Whether every parameter has been stepped equally often for every client: then a step of all clients is
        :meth:`step_device` then :meth:`count`, a step a CUDA graph can replay."""
        return all(self.even.values())

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors a step of all clients reads and rewrites in place besides parameters and gradients (momentum
        buffers, Adam's moments and device step counts): a CUDA graph of the step is bound to these."""
        return [t for k in self.params for t in (*self.state[k], self.device_steps.get(k)) if t is not None]

    @torch.no_grad()
    def step_device(self) -> None:
        """:meth:`step` of every client (``uniform()`` holds) without the host's step counts: only device work
        and Python bookkeeping that a repeat leaves as it is, so a CUDA graph of it replays the step; each
        step taken this way is counted by :meth:`count`."""
        self._stepped = self._together()
        for spec, keys in self._stepped.items():
            self._step_together(spec, keys)

    def count(self, left_out: torch.Tensor | None = None) -> None:
        """The host's step counts of the last :meth:`step_device`, or of a replay of it (the parameters it stepped,
        found once, not again at every replay); the clients of ``left_out`` (host bool mask), whose rows a masked
        replay put back, keep theirs (the caller steps them next)."""
        for keys in self._stepped.values():
            self._count_together(keys)
            if left_out is not None:
                for k in keys:
                    self.steps[k] -= left_out.double()
                    self.even[k] = False

    def _together(self) -> dict[OptimSpec, list[str]]:
        together: dict[OptimSpec, list[str]] = {}
        for key, p in self.params.items():
            if p.grad is not None:  # a parameter the loss never used: torch.optim skips it too
                together.setdefault(self.specs[key], []).append(key)
        return together

    def _count_together(self, keys: list[str]) -> None:
        torch._foreach_add_([self.steps[k] for k in keys], 1.0)  # host tensors: one op, as torch.optim counts
        if self._device_count:  # Adam's device counts (none for SGD: nothing to walk on a replay's host path)
            for k in keys:
                if k in self._device_count:
                    self._device_count[k] += 1.0
        self.multi_tensor_steps += 1

    def _step_together(self, spec: OptimSpec, keys: list[str]) -> None:
        """torch.optim's multi-tensor step for ``keys`` (every client active, all at the same step count); the
        step counts are the caller's (:meth:`_count_together`)."""
        params = [self.params[k] for k in keys]
        grads = [p.grad for p in params]
        if spec.kind == "adam":
            moments = [[torch.zeros_like(p) if s is None else s for s in self.state[k]] for k, p in zip(keys, params)]
            for k, p in zip(keys, params):
                if k not in self.device_steps:
                    self._device_count[k] = float(self.steps[k][0])
                    self.device_steps[k] = torch.tensor(self._device_count[k], dtype=torch.float32, device=p.device)
            adam_functional(params, grads, [m for m, _ in moments], [v for _, v in moments], [],
                            [self.device_steps[k] for k in keys], foreach=True, amsgrad=False,
                            capturable=params[0].device.type == "cuda", beta1=spec.betas[0], beta2=spec.betas[1],
                            lr=spec.lr, weight_decay=spec.weight_decay, eps=ADAM_EPS, maximize=False)
            new_state = [list(mv) for mv in moments]
        else:
            bufs = [self.state[k][0] for k in keys]
            sgd_functional(params, grads, bufs, foreach=True, weight_decay=spec.weight_decay, momentum=spec.momentum,
                           lr=spec.lr, dampening=0.0, nesterov=False, maximize=False)
            new_state = [[b, None] for b in bufs]
        for k, st in zip(keys, new_state):
            self.state[k] = st

    def _step_one(self, key: str, p: torch.Tensor, mask: torch.Tensor | None, host_mask: torch.Tensor | None) -> None:
        """``key``'s step alone: the clients where ``mask`` is True move, the others keep their rows."""
        g, spec = p.grad, self.specs[key]
        before = self.steps[key].clone()
        self.steps[key] += 1 if host_mask is None else host_mask.double()
        self.even[key] = bool((self.steps[key] == self.steps[key][0]).all())
        if not (self.even[key] and self._device_count.get(key) == float(self.steps[key][0])):
            # the device count no longer holds every client's: made again from the host's if the clients meet again
            self.device_steps.pop(key, None)
            self._device_count.pop(key, None)
        if spec.weight_decay:
            g = g.add(p, alpha=spec.weight_decay)
        new_p, new_state = (self._adam if spec.kind == "adam" else self._sgd)(key, spec, p, g, before)
        if mask is not None:
            rows = mask.view(-1, *[1] * (p.dim() - 1))
            new_p = torch.where(rows, new_p, p)
            # A client that has not stepped yet keeps zero state (Adam's moments start at zero; SGD's
            # momentum buffer is started from the first gradient, see _sgd)
            new_state = [None if s_new is None else
                         torch.where(rows, s_new, torch.zeros_like(s_new) if s_old is None else s_old)
                         for s_new, s_old in zip(new_state, self.state[key])]
        p.copy_(new_p)
        # in place where the state exists: a CUDA graph of the usual step stays bound to it (a masked replay's
        # left-out clients step here, between replays)
        self.state[key] = [s_new if s_old is None or s_new is None else s_old.copy_(s_new)
                           for s_new, s_old in zip(new_state, self.state[key])]

    _NAMES = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer", None)}

    def load(self, clients: list[dict[str, dict[str, Any]]]) -> None:
        """Continue each client's optimizer state of an earlier round (see ``StepwiseTraining.optimizer_state``)."""
        for key, p in self.params.items():
            if not any(key in c for c in clients):
                continue
            names = self._NAMES[self.specs[key].kind]
            self.device_steps.pop(key, None)
            self._device_count.pop(key, None)
            self.steps[key] = torch.tensor([float(c.get(key, {}).get("step", 0)) for c in clients], dtype=torch.float64)
            self.even[key] = bool((self.steps[key] == self.steps[key][0]).all())
            self.state[key] = [None if name is None else torch.stack(
                [c[key][name].to(p.device, p.dtype) if key in c and name in c[key] else torch.zeros_like(p[0])
                 for c in clients]) for name in names]

    def client_state(self, i: int) -> dict[str, dict[str, Any]]:
        """Client ``i``'s optimizer state now, by parameter (parameters it never stepped are left out)."""
        out = {}
        for key in self.params:
            steps = int(self.steps[key][i].item())  # one host read, not a tensor comparison, a parameter and client
            if steps > 0:
                names = self._NAMES[self.specs[key].kind]
                out[key] = {"step": steps, **{name: value[i].detach() for name, value in
                                              zip(names, self.state[key]) if name and value is not None}}
        return out

    @staticmethod
    def _rows(values: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return values.to(p.device).view(-1, *[1] * (p.dim() - 1))

    def _sgd(self, key, spec, p, g, before):
        buf = self.state[key][0]
        if spec.momentum:
            # torch.optim.SGD starts a parameter's buffer at its first gradient
            if buf is None:
                buf = g.clone()
            elif bool((before > 0).all()):  # every client past its first step (host counts: no device mask needed)
                buf = buf.mul(spec.momentum).add_(g)
            else:
                buf = torch.where(self._rows(before > 0, p), buf.mul(spec.momentum).add_(g), g.clone())
            g = buf
        return torch.add(p, g, alpha=-spec.lr), [buf, None]

    def _adam(self, key, spec, p, g, before):
        (b1, b2), lr = spec.betas, spec.lr
        m, v = self.state[key]
        m = torch.zeros_like(p) if m is None else m
        v = torch.zeros_like(p) if v is None else v
        m = m.lerp(g, 1 - b1)
        v = v.mul(b2).addcmul_(g, g, value=1 - b2)
        steps = (before + 1).clamp_min(1)  # this step's count for the clients that take it
        if bool((steps == steps[0]).all()):  # the common case: torch's scalar arithmetic exactly
            t = float(steps[0])
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(ADAM_EPS)
            return torch.addcdiv(p, m, denom, value=-lr / (1 - b1**t)), [m, v]
        bc1 = self._rows(1 - b1**steps, p).to(p.dtype)
        bc2 = self._rows((1 - b2**steps).sqrt(), p).to(p.dtype)
        denom = (v.sqrt() / bc2).add_(ADAM_EPS)
        return p - (lr / bc1) * (m / denom), [m, v]
