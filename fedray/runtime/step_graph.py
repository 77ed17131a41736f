"""CUDA graphs of the vectorised lockstep step (``runtime.cuda_graphs``): :class:`StepGraph` captures the usual
step of ``fedray.runtime.vectorized.train_vectorized`` once a round and replays it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from fedray.algorithms.training import Update
from fedray.runtime.stacked_optimizer import StackedOptimizer

log = logging.getLogger("fedray")

# where StepGraph may run: CUDA only (tests add "cpu", with capture replaced by a plain call of the body)
GRAPH_DEVICES = ("cuda",)


def capture(body: Callable[[], None], stream: Any) -> Callable[[], None]:
    """``body``'s device work recorded once as a CUDA graph on ``stream`` (its Python runs now, its kernels do
    not); returns the graph's replay, which runs them. ``CUDAGraph.capture_begin``/``capture_end`` directly, not
    the ``torch.cuda.graph`` context, which synchronises the device and empties torch's device and pinned-host
    memory caches before each capture: once a round here, and refilling them costs more than the graph saves
    on a small model."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            body()
        finally:
            graph.capture_end()
    return graph.replay


class StepGraph:
    """The lockstep's usual step replayed as one CUDA graph (``runtime.cuda_graphs``).

    A vectorised step of a small model is a few hundred kernels of microseconds each, and issuing them from Python
    takes longer than the GPU takes to run them: measured on an H200 (``benchmarks/step_ceiling.py``), 8 LeNet-5
    clients' step took 4.4 ms eager and 0.54 ms as a graph replay. So after :attr:`WARMUP` eager steps (the first
    makes SGD's momentum buffers and the figures' sums, allocations a replay could not repeat), the next step of
    every client is captured - the gather of its batches from a fixed index tensor, the vmapped loss, ``backward``,
    the optimizer's device step - and each later such step copies its batch index into that tensor and replays
    the graph; the optimizer's host step counts are kept by :meth:`StackedOptimizer.count`.

    It holds while a step is one group of all clients running one update, with SGD at even step counts, batches
    gathered on the device and no inputs drawn on the host (FedAvg and the methods built on ``LocalTraining``).
    At the first step that is not (clients done early, a short batch left unpadded, a batch of another width)
    the graph is dropped and the round goes on eagerly; a capture that fails does the same, with a warning.
    Replays run the eager step's kernels on the same tensors, so the numbers are the eager steps'. Warm-up,
    capture and replays share one side stream, as torch's CUDA graph notes ask of warm-up and capture.
    """

    WARMUP = 2  # eager steps before the capture
    MIN_REPLAYS = 2  # steps left for the graph to repay its capture (about an eager step's host time)

    def __init__(self, device: torch.device, body: Callable[[torch.Tensor], None]):
        self.device, self.body = device, body
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.warm = self.replays = 0
        self.replay: Callable[[], None] | None = None
        self.static: torch.Tensor | None = None
        self.dropped = False

    @staticmethod
    def possible(device: torch.device, updates: list[Update], batched: Any) -> bool:
        return device.type in GRAPH_DEVICES and len(updates) == 1 and updates[0].trains is None and batched is not None

    @contextlib.contextmanager
    def running(self):
        """The steps on the side stream (which starts after the work queued so far and is waited for after)."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            main.wait_stream(self.stream)

    def step(self, index: torch.Tensor | None, opt: StackedOptimizer, steps_left: int) -> bool:
        """Take this step by a replay (True), or leave it to the eager path (False); ``index``: the step's batch
        index if it is one of all clients (``fedray.runtime.vectorized._whole_step``)."""
        if self.dropped:
            return False
        fits = index is not None and opt.uniform() and (self.static is None or index.shape == self.static.shape)
        if not fits:
            self.dropped = self.replay is not None  # eager from here on: the graph's tensors may be replaced
            return False
        if self.replay is None:
            if self.warm < self.WARMUP or steps_left < self.MIN_REPLAYS:
                self.warm += 1
                return False
            if not self._record(index):
                return False
        self.static.copy_(index)
        self.replay()
        opt.count()
        self.replays += 1
        return True

    def _record(self, index: torch.Tensor) -> bool:
        self.static = index.clone()
        try:
            self.replay = capture(lambda: self.body(self.static), self.stream)
        except Exception as exc:  # e.g. a loss that reads a tensor on the host: the round goes on eagerly
            log.warning("runtime.cuda_graphs: the local step could not be captured as a CUDA graph (%s: %s); "
                        "running it eagerly", type(exc).__name__, exc)
            self.dropped = True
            return False
        return True
