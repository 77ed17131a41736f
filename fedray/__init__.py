"""fedray: a Ray-based simulator for federated learning and federated knowledge distillation.

The package's parts, each depending only on those listed below it:

- ``cli``: the command line (run, tune, report, partition, models).
- ``report``: ``fedray report``: finished runs as the papers' tables, learning curves and per-client spreads.
- ``sweep``: Ray Tune sweeps: their specs, the runner, the sweep's report (above the simulation).
- ``simulation``: the round loop: sample, run a round on a runtime, evaluate, track, checkpoint.
- ``runtime``: where the work runs: in this process, or Ray actors (with ``sweep`` the only part importing ray).
- ``vectorized``: the vectorised-client engine (lockstep over stacked clients); the runtime chooses it.
- ``record``: a run's record: checkpoints, its output directory, MLflow tracking and provenance, the terminal.
- ``evaluation``: the figures ``eval/*`` reports (accuracy, FedKF's AMP / FM / WLP, per-client scores).
- ``methods``: the method contract (``methods.api``), one module per method, the registry.
- ``learning``: what methods share: the client/server boundary types, local training, distillation, ensembles,
  functional optimizers, weight arithmetic, subspaces, cached-model aggregation, CUDA-graph steps.
- ``data``, ``models``: datasets, partitions and server data; the model zoo and generators.
- ``config``, ``paths``, ``errors``, ``seeding``, ``overrides``, ``validation``, ``gc_pause``: the foundation.
"""

__version__ = "0.1.0"
