"""SGD and Adam as ``torch.optim`` computes them, without ``torch.optim.Optimizer``.

A step calls torch.optim's own functional ``sgd``/``adam`` (what ``SGD.step``/``Adam.step`` call) with the
arguments those steps pass for the settings used here, and the state is kept as theirs (per parameter:
``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``), so the numbers are torch.optim's bit for bit
(``tests/learning/test_optim.py``). What is left out is the ``Optimizer`` machinery: its methods import torch's
compiler stack on first use (``torch._disable_dynamo``: about 1 s and 150 MB in every process that trains, paid
by each Ray actor at start-up), and hooks, closures, sparse gradients, ``state_dict``. Any method may still use
``torch.optim`` itself; fedray's own methods use these.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

ADAM_EPS = 1e-8  # torch.optim.Adam's default


class _Optimizer:
    """Parameter groups (an iterable of parameters, or of dicts with ``params`` and settings overriding the
    defaults) and per-parameter state, as in ``torch.optim``."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    def zero_grad(self) -> None:
        """Gradients to None (``torch.optim``'s default ``set_to_none=True``)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @staticmethod
    def _with_grad(group: dict[str, Any]) -> list[torch.Tensor]:
        return [p for p in group["params"] if p.grad is not None]  # torch.optim skips the others too


class SGD(_Optimizer):
    """``torch.optim.SGD(params, lr, momentum, weight_decay)`` (no dampening, no Nesterov)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = self._with_grad(group)
            momentum = group["momentum"]
            bufs = [self.state.get(p, {}).get("momentum_buffer") for p in params] if momentum else []
            sgd_functional(params, [p.grad for p in params], bufs, weight_decay=group["weight_decay"],
                           momentum=momentum, lr=group["lr"], dampening=0.0, nesterov=False, maximize=False)
            for p, buf in zip(params, bufs):  # started from the first gradient by sgd itself
                self.state.setdefault(p, {})["momentum_buffer"] = buf


class Adam(_Optimizer):
    """``torch.optim.Adam(params, lr, betas, weight_decay)`` (L2 weight decay, eps 1e-8, no AMSGrad)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    def init_state(self, p: torch.Tensor, step: int = 0, exp_avg: torch.Tensor | None = None,
                   exp_avg_sq: torch.Tensor | None = None) -> None:
        """``p``'s state: fresh (zeros), or continued from ``step`` steps taken and copies of saved moments."""

        def moment(saved: torch.Tensor | None) -> torch.Tensor:
            if saved is None:
                return torch.zeros_like(p, memory_format=torch.preserve_format)
            return saved.to(device=p.device, dtype=p.dtype, copy=True)

        # as torch.optim keeps it: a host scalar in the default float precision
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        self.state[p] = {"step": torch.tensor(float(step), dtype=scalar), "exp_avg": moment(exp_avg),
                         "exp_avg_sq": moment(exp_avg_sq)}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = self._with_grad(group)
            for p in params:
                if p not in self.state:
                    self.init_state(p)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam_functional(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], amsgrad=False,
                            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                            eps=ADAM_EPS, maximize=False)
