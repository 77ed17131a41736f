"""Where the work runs: in-process (``local``) or on Ray (``ray``). The only package that imports ray.

Importing the package imports neither torch nor ray (``fedray run`` starts Ray through
:mod:`fedray.runtime.ray_start` before it imports torch); ``Runtime`` and ``RoundOutcome`` are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedray.config import ExperimentConfig
    from fedray.data.federated import FederatedData
    from fedray.methods import Experiment
    from fedray.runtime.base import RoundOutcome, Runtime


def make_runtime(experiment: Experiment | ExperimentConfig, data: FederatedData | None = None,
                 owns_ray: bool | None = None) -> Runtime:
    """The one factory of runtimes: the one ``runtime.backend`` names, for a resolved experiment (a config is
    resolved here). Without ``data``, give it the data with ``attach`` before the first round: the Ray runtime
    starts its actors first, so they start while the data loads. ``owns_ray``: see :class:`RayRuntime`."""
    from fedray.methods import resolve_experiment

    exp = resolve_experiment(experiment)
    if exp.cfg.runtime.backend == "ray":
        from fedray.runtime.ray_runtime import RayRuntime  # imports ray only when asked for

        return RayRuntime(exp, data, owns_ray)
    from fedray.runtime.local import LocalRuntime

    return LocalRuntime(exp, data)


def __getattr__(name: str) -> Any:
    if name in ("RoundOutcome", "Runtime"):
        from fedray.runtime import base

        return getattr(base, name)
    raise AttributeError(f"module 'fedray.runtime' has no attribute {name!r}")


__all__ = ["RoundOutcome", "Runtime", "make_runtime"]
