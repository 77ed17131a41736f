"""A run's record: what a run leaves behind while and after it runs.

:mod:`~fedray.record.checkpoint` (the resumable state), :mod:`~fedray.record.run_dir` (the output directory's files:
config, history, summary, per-client history, curves), :mod:`~fedray.record.tracking` (MLflow) with
:mod:`~fedray.record.provenance` (what a run came from) and :mod:`~fedray.record.console` (the terminal). The
evaluation that makes the figures is :mod:`fedray.evaluation`; ``fedray report``'s tables and plots of finished runs
are :mod:`fedray.report`, which nothing here imports.
"""
