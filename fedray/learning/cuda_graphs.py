"""CUDA graphs of repeated steps (``runtime.cuda_graphs``): a step that runs the same kernels on new inputs, over and
over (a vectorised local step, a server's distillation step), recorded once and replayed.

A step of a small model is a few hundred kernels of microseconds each, and issuing them from Python takes longer
than the GPU takes to run them: measured on an H200 (``benchmarks/speed/step_ceiling.py``), 8 LeNet-5 clients' vectorised
step took 4.4 ms eager and 0.54 ms replayed. Kept apart from the runtime because both the runtime's vectorised
clients (:class:`fedray.vectorized.step_graph.StepGraph`) and methods' server loops
(:class:`fedray.learning.distill.KDSteps`: DaFKD's, FedDF's and FedD3A's distillation) use it; it picks nothing by
where it runs, only by the tensors' device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger("fedray")

# where a GraphedStep records graphs: CUDA only (tests add "cpu", with capture replaced by a plain call of the body)
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


class GraphedStep:
    """``body(key, inputs)`` replayed as one CUDA graph once it has run :attr:`WARMUP` times eagerly with the same
    ``key`` and input shapes.

    The caller runs each step eagerly itself unless :meth:`replay` says it took it. ``key`` names what the body does
    besides its input tensors (flags it branches on); a step with another key or other input shapes is left to the
    caller, the graph kept for later steps that fit. Before a replay the step's ``inputs`` (device or host tensors)
    are copied into the tensors the graph was recorded on; the body's return value (e.g. a loss) is the graph's
    output, rewritten by every replay. The warm-up makes what a replay cannot (optimizer state, the body's
    accumulators); warm-up, capture and replays share one side stream, as torch's CUDA graph notes ask.
    A capture that fails logs a warning, and every later step is the caller's.
    """

    WARMUP = 2  # eager steps before the capture
    MIN_REPLAYS = 2  # steps left for the graph to repay its capture (about an eager step's host time)

    def __init__(self, device: torch.device, body: Callable[[Hashable, dict[str, torch.Tensor]], Any], what: str):
        self.device, self.body, self.what = device, body, what
        self.enabled = device.type in GRAPH_DEVICES
        self.stream = torch.cuda.Stream(device) if self.enabled and device.type == "cuda" else None
        self.key: Hashable = None
        self.warm = self.replays = 0
        self._replay: Callable[[], None] | None = None
        self.static: dict[str, torch.Tensor] = {}
        self.out: Any = None
        self.dropped = False

    @property
    def recorded(self) -> bool:
        return self._replay is not None

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

    def replay(self, key: Hashable, inputs: dict[str, torch.Tensor], steps_left: int | None = None) -> bool:
        """Take this step by a replay (True; its output in :attr:`out`), or leave it to the caller (False).
        ``steps_left`` (this one included), where known, skips a capture that too few replays would repay."""
        if self.dropped or not self.enabled:
            return False
        full = (key, tuple((k, tuple(v.shape), v.dtype) for k, v in inputs.items()))
        if full != self.key:
            if self.recorded:
                return False  # another kind of step: the caller's, the graph kept for the next that fits
            self.key, self.warm = full, 0
        if not self.recorded:
            if self.warm < self.WARMUP or (steps_left is not None and steps_left < self.MIN_REPLAYS):
                self.warm += 1
                return False
            if not self._record(key, inputs):
                return False
        for name, value in inputs.items():
            self.static[name].copy_(value)
        self._replay()
        self.replays += 1
        return True

    def drop(self) -> None:
        """No more replays (the tensors the graph was recorded on were replaced)."""
        self.dropped = True

    def _record(self, key: Hashable, inputs: dict[str, torch.Tensor]) -> bool:
        self.static = {k: torch.empty_like(v, device=self.device) for k, v in inputs.items()}

        def body() -> None:
            self.out = self.body(key, self.static)

        try:
            self._replay = capture(body, self.stream)
        except Exception as exc:  # e.g. a step that reads a tensor on the host: it goes on eagerly
            log.warning("runtime.cuda_graphs: %s could not be captured as a CUDA graph (%s: %s); running it eagerly",
                        self.what, type(exc).__name__, exc)
            self.dropped = True
            return False
        return True
