"""CUDA graphs of the vectorised lockstep step (``runtime.cuda_graphs``): :class:`StepGraph` captures the usual
step of ``fedray.vectorized.engine.train_vectorized`` once a round and replays it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch

from fedray.learning import cuda_graphs
from fedray.learning.cuda_graphs import GraphedStep
from fedray.vectorized.stacked_optimizer import StackedOptimizer


class StepGraph:
    """The lockstep's usual step replayed as one CUDA graph (:class:`fedray.learning.cuda_graphs.GraphedStep`).

    After the warm-up's eager steps (the first makes the optimizers' state and the figures' sums, allocations a
    replay could not repeat), the next step of every client is captured - the gather of its batches from a fixed
    index tensor, the noise and other inputs drawn on the host copied into fixed tensors, each of the step's updates
    (vmapped loss, ``backward``, the optimizer's device step: SGD, or Adam with its step counts on the device) - and
    each later such step copies its inputs into those tensors and replays the graph; the optimizers' host step
    counts are kept by :meth:`StackedOptimizer.count`.

    A step fits while it is one group of all clients with the captured step's updates and input shapes, every
    optimizer at one step count for all clients. A step that does not (a short batch left unpadded under
    BatchNorm, another width) runs eagerly and the graph is kept (eager steps write the optimizer state in place);
    once the optimizer state the graph was recorded on has been replaced (state made after the capture), it is
    dropped for the rest of the round. (Clients done early end a lockstep: the rest train in a lockstep of their
    own, with a graph of its own.)
    Replays run the eager step's kernels on the same tensors, so the numbers are the eager steps'.

    A *masked* graph (``masked``: chosen for a round where more than :data:`MASKED_FROM` of the steps are split
    by batch length, e.g. many alpha = 0.1 clients under BatchNorm, where a plain graph would hardly replay)
    also takes a split step: every client runs the step of its largest group of full batches (a short batch's
    rows repeating its first, all clients' rows being independent under ``vmap``), the clients outside that
    group end it as they began (their parameters, buffers, optimizer state and figures put back inside the
    graph, by the input ``mask``), and they then take their own step eagerly (:meth:`plan`). Each client's
    numbers are those of its eager step up to float rounding (a replay runs a client in a larger vmapped call
    than its eager group); the put-back costs a copy of the state a step.
    """

    #: the share of a round's steps split by batch length above which the round's graph is masked
    MASKED_FROM = 0.5

    def __init__(self, device: torch.device, body: Callable[[Hashable, dict[str, torch.Tensor]], None],
                 masked: bool = False):
        self.graph = GraphedStep(device, body, "the local step")
        self.masked = masked
        self._recorded_on: list[torch.Tensor] = []
        self._everyone: torch.Tensor | None = None

    @staticmethod
    def possible(device: torch.device) -> bool:
        return device.type in cuda_graphs.GRAPH_DEVICES

    @property
    def replays(self) -> int:
        return self.graph.replays

    def running(self):
        return self.graph.running()

    def plan(self, groups: dict[tuple, list[int]], host: dict[tuple, dict[str, torch.Tensor]], batched: Any, s: int,
             n: int) -> tuple[tuple, dict[str, torch.Tensor], dict[tuple, list[int]], torch.Tensor | None] | None:
        """Step ``s`` (its clients' ``groups`` keyed by (flags, input shapes, batch group) and their stacked host
        inputs ``host``; ``batched``: the round's ``RoundBatches``) as a graph step: (key, inputs, the groups left
        to the eager path, the clients left out as a host bool mask or None), or None when it cannot be one.

        A step of one group of all clients is the plain step. A split step, in a masked graph, runs its largest
        group of the step's longest batches for every client, with the batches of ``batched.full_step`` and zeros
        as the other clients' host inputs, and leaves the other groups out."""
        if len(groups) == 1:
            group, members = next(iter(groups.items()))
            index = batched.whole_step(s, n) if len(members) == n else None
            if index is None:
                return None
            if not self.masked:
                return (group[0],), {"index": index, **host[group]}, {}, None
            if self._everyone is None or len(self._everyone) != n:
                self._everyone = torch.ones(n, dtype=torch.bool)
            return (group[0],), {"index": index, "mask": self._everyone, **host[group]}, {}, None
        index = batched.full_step(s) if self.masked else None
        if index is None:
            return None
        full = [g for g in groups if batched.width(g[2]) == index.shape[2]]
        if not full:
            return None
        main = max(full, key=lambda g: len(groups[g]))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[groups[main]] = True
        inputs = {"index": index, "mask": mask}
        for name, value in host[main].items():
            inputs[name] = value.new_zeros((n, *value.shape[1:]))
            inputs[name][mask] = value
        return (main[0],), inputs, {g: m for g, m in groups.items() if g != main}, ~mask

    @contextlib.contextmanager
    def keeping(self, mask: torch.Tensor | None, tensors: list[torch.Tensor], opts: list[StackedOptimizer]):
        """Inside a masked graph's body: the clients outside ``mask`` (device bool, (K,)) end the step with the
        rows of ``tensors`` and of the optimizers' per-client state they began it with. No-op without a mask."""
        if mask is None:
            yield
            return
        n = mask.shape[0]
        kept = [*tensors, *(t for t in self._state(opts) if t.dim() > 0 and t.shape[0] == n)]
        before = [t.detach().clone() for t in kept]
        yield
        with torch.no_grad():
            for t, b in zip(kept, before):
                t.copy_(torch.where(mask.view(-1, *[1] * (t.dim() - 1)), t, b))

    def step(self, key: Hashable, inputs: dict[str, torch.Tensor], opts: list[StackedOptimizer], steps_left: int,
             left_out: torch.Tensor | None = None) -> bool:
        """Take this step of all clients by a replay (True), or leave it to the eager path (False). ``key`` and
        ``inputs``: from :meth:`plan`; ``opts``: the optimizers of the updates it runs; ``left_out``: the clients a
        masked replay puts back, whose step the caller then takes (their host step counts are not advanced)."""
        if not all(opt.uniform() for opt in opts):
            return False
        now = self._state(opts)
        if self.graph.recorded and (len(now) != len(self._recorded_on)
                                    or any(a is not b for a, b in zip(now, self._recorded_on))):
            self.graph.drop()  # an eager step replaced optimizer state the graph steps
        was = self.graph.recorded
        if not self.graph.replay(key, inputs, steps_left):
            return False
        if not was:
            self._recorded_on = self._state(opts)  # the capture's step made no new state: the warm-up did
        for opt in opts:
            opt.count(left_out)
        return True

    @staticmethod
    def _state(opts: list[StackedOptimizer]) -> list[torch.Tensor]:
        return [t for opt in opts for t in opt.state_tensors()]
