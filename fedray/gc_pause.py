"""Heavy imports without Python's cyclic garbage collector.

Importing torch, pydantic and fedray allocates ~200,000 objects that live as long as the process, and the
collector's generational thresholds make it traverse them again and again while they load: in a Ray actor
(whose heap already holds Ray's own modules) 0.33-0.42 s of CPU per process in ~380 young, ~35 middle and
3 full collections, which found fewer than 200 unreachable objects among them. A run on Ray starts three
such processes on a start-up that is CPU-bound on a small machine (``benchmarks/README.md``).

:func:`imports_without_gc` pauses the collector for the block, then (by default) *freezes* every object the
process holds (``gc.freeze``: moved to a permanent generation that later collections skip) and restores the
collector. A frozen object in a reference cycle is never reclaimed, so freezing is for processes fedray owns
(a Ray actor, the ``fedray`` command) and blocks that hold imports only; where fedray runs inside someone
else's process (a notebook, a script calling :func:`fedray.simulation.run_experiment`) it pauses without
freezing: the imports' objects are then traversed a few times more, not dozens. Stdlib only.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def imports_without_gc(freeze: bool = True) -> Iterator[None]:
    """No cyclic collection inside the block; afterwards (with ``freeze``) every object tracked so far is
    frozen, and the collector is on again if it was on before (also when the block raises)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()
