"""CUDA graphs of the vectorised lockstep step (``runtime.cuda_graphs``): :class:`StepGraph` captures the usual
step of ``fedray.runtime.vectorized.train_vectorized`` once a round and replays it."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from fedray import cuda_graphs
from fedray.cuda_graphs import GraphedStep
from fedray.runtime.stacked_optimizer import StackedOptimizer


class StepGraph:
    """The lockstep's usual step replayed as one CUDA graph (:class:`fedray.cuda_graphs.GraphedStep`).

    After the warm-up's eager steps (the first makes the optimizers' state and the figures' sums, allocations a
    replay could not repeat), the next step of every client is captured - the gather of its batches from a fixed
    index tensor, the noise and other inputs drawn on the host copied into fixed tensors, each of the step's updates
    (vmapped loss, ``backward``, the optimizer's device step: SGD, or Adam with its step counts on the device) - and
    each later such step copies its inputs into those tensors and replays the graph; the optimizers' host step
    counts are kept by :meth:`StackedOptimizer.count`.

    A step fits while it is one group of all clients with the captured step's updates and input shapes, every
    optimizer at one step count for all clients. A step that does not (a short batch left unpadded under
    BatchNorm, another width) runs eagerly and the graph is kept; once an eager step has replaced the optimizer
    state the graph was recorded on (a masked step: clients done early), it is dropped for the rest of the round.
    Replays run the eager step's kernels on the same tensors, so the numbers are the eager steps'.
    """

    def __init__(self, device: torch.device, body: Callable[[Hashable, dict[str, torch.Tensor]], None]):
        self.graph = GraphedStep(device, body, "the local step")
        self._recorded_on: list[torch.Tensor] = []

    @staticmethod
    def possible(device: torch.device) -> bool:
        return device.type in cuda_graphs.GRAPH_DEVICES

    @property
    def replays(self) -> int:
        return self.graph.replays

    def running(self):
        return self.graph.running()

    def step(self, key: Hashable, inputs: dict[str, torch.Tensor], opts: list[StackedOptimizer], steps_left: int) -> bool:
        """Take this step of all clients by a replay (True), or leave it to the eager path (False). ``key`` and
        ``inputs``: the step's flags, batch index and host inputs (``fedray.runtime.vectorized._whole_step``);
        ``opts``: the optimizers of the updates it runs."""
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
            opt.count()
        return True

    @staticmethod
    def _state(opts: list[StackedOptimizer]) -> list[torch.Tensor]:
        return [t for opt in opts for t in opt.state_tensors()]
