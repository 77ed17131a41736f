"""``fedray run | tune | report | partition | models``: the command line.

- ``run``: one experiment (a preset or YAML file plus dotted overrides), or ``--resume`` one from its checkpoint;
- ``tune``: a Ray Tune sweep from a spec (``tune_configs/``);
- ``report``: finished runs compared as a Markdown table (mean ± std over seeds) and learning curves; with
  ``--clients RUN`` one run's spread over its clients, round by round (``clients.parquet``); ``--events RUN``
  what became of each round's selected clients (``events.parquet``);
- ``partition``: the clients' sample counts per label, optionally plotted;
- ``models``: the model zoo, with parameters and feature size for a dataset.

A mistake the user can fix (config, data path, resources) ends with one line on stderr naming the key
and what is allowed, and exit status 2; no traceback and no result files.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from fedray.errors import ConfigError, RunFailure, UserError, clear_interrupted, interrupt

EXIT_USAGE = 2
MAX_TABLE_ROWS = 100


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        print(f"error: {message} (see 'fedray {self.prog.split()[-1]} --help')", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _add_config_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("config", nargs="?" if optional else None, help="a preset name (e.g. quickstart) or a YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides: data.alpha=0.5 federation.rounds=10 ...")
    p.add_argument("--data-dir", help="dataset root (torchvision layout); sets data.data_dir")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedray", description="Federated learning and distillation simulator on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one experiment and print its result table")
    _add_config_args(run, optional=True)
    run.add_argument("--output-dir", help="where summary.json and history.parquet go (default runs/NAME-TIME)")
    run.add_argument("--resume", metavar="DIR", help="continue the run whose checkpoint is in DIR: alone, or after "
                     "the command that started it (CONFIG and overrides must give its experiment; runtime.*, "
                     "tracking.* and where the data is read from may differ)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    part = sub.add_parser("partition", help="print per-client sample counts; optionally plot them")
    _add_config_args(part)
    part.add_argument("--plot", help="write the client-by-label bubble plot (FedKF Fig. 4) to this PNG")
    tune = sub.add_parser("tune", help="run a Ray Tune sweep from a spec in tune_configs/")
    tune.add_argument("spec", help="a sweep spec YAML, e.g. tune_configs/fedprox_mu.yaml")
    tune.add_argument("--num-samples", type=int, help="override the spec's num_samples")
    tune.add_argument("--max-concurrent", type=int, help="at most this many trials at once")
    tune.add_argument("--name", help="sweep name (default: SPEC's stem and a timestamp)")
    tune.add_argument("--resume", action="store_true", help="continue the latest (or --name) sweep of SPEC")
    tune.add_argument("--address", help="Ray cluster to run on (default: start a local one)")
    tune.add_argument("--dry-run", action="store_true", help="print the trials and their resource bundles; "
                      "start nothing")
    tune.add_argument("--verbose", action="store_true", help="Tune's status block and Ray's own lines on the "
                      "terminal (default: one line per trial event; Ray's and Tune's logs in the sweep's ray.log)")
    models = sub.add_parser("models", help="list the model zoo: parameters and feature size for a dataset")
    _add_config_args(models, optional=True)
    models.add_argument("--dataset", help="the dataset whose input shape and classes to use (sets data.dataset)")
    rep = sub.add_parser("report", help="compare runs: a Markdown table (mean ± std over seeds) and curves")
    rep.add_argument("runs", nargs="*", help="run directories, or folders holding them")
    rep.add_argument("--experiment", help="also (or only) the finished runs of this MLflow experiment")
    rep.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI or ./mlflow.db)")
    rep.add_argument("--target", type=float, help="report rounds to reach this accuracy (0.6 or 60)")
    rep.add_argument("--by-method", default="algorithm.name", help="comma-separated keys naming a method")
    rep.add_argument("--by-setting", default="data.dataset,data.alpha", help="comma-separated keys of a setting")
    rep.add_argument("--out", help="also write the table to this Markdown file")
    rep.add_argument("--plot", help="write learning curves (mean ± std over seeds) to this PNG; with --clients, the "
                     "clients' spread (default RUN/clients.png)")
    rep.add_argument("--events", metavar="RUN", help="one run's simulated system instead: per round the clients "
                     "aggregated, straggling, dropped out or lost, and the slowest arrival (its events.parquet)")
    rep.add_argument("--clients", metavar="RUN", help="one run's clients instead: per evaluated round the worst, "
                     "median and best client accuracy, FM and WLP, and which client is worst (its clients.parquet)")
    parser.commands = sub.choices  # for intermixed parsing in main()
    return parser


def _load(args: argparse.Namespace, registries: bool = True):
    """The config of ``args``; with ``registries=False`` only what :func:`fedray.load.load_config` checks
    (no method imported, so no torch): the rest is :func:`fedray.methods.validate_experiment`'s."""
    from fedray.load import load_config

    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    cfg = load_config(args.config, overrides)
    if registries:
        from fedray.methods import validate_experiment

        cfg = validate_experiment(cfg)
    return cfg


def _check_writable(option: str, path: Path, folder: bool) -> None:
    """Refuse an output path that cannot be written (``folder``: a directory, else a file; missing folders
    above it are made) now, not after the data load, the training or the start of an MLflow run."""
    if path.exists() and path.is_dir() != folder:
        raise ConfigError(option, f"{path} exists and is {'not ' if folder else ''}a directory; choose another path")
    above = next(p for p in [*([path] if folder else []), *path.absolute().parents] if p.exists())
    what = "is not a directory" if not above.is_dir() else None
    if what is None:
        try:  # a real try, not os.access: root passes that everywhere, read-only mounts and /proc included
            tempfile.TemporaryDirectory(dir=above).cleanup()
        except OSError as e:
            what = f"is not writable ({e.strerror or e})"
    if what is not None:
        raise ConfigError(option, f"cannot create {path}: {above} {what}; choose another path")


def _check_plot(option: str, value: str) -> None:
    """A plot's path: writable, and an image format matplotlib writes (named by its suffix; none: PNG)."""
    path = Path(value)
    _check_writable(option, path, folder=False)
    if path.suffix:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if path.suffix[1:].lower() not in kinds:
            raise ConfigError(option, f"{path.suffix} is no image format matplotlib writes; use one of "
                              f"{', '.join(sorted(kinds))}")


def _output_dir(args: argparse.Namespace, name: str) -> Path:
    if args.output_dir:
        out = Path(args.output_dir)
        _check_writable("--output-dir", out, folder=True)
        return out
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _check_writable("--output-dir", base, folder=True)
    # Made here, atomically: runs started in the same second (seeds launched together) get base, base-2, ...,
    # not one folder. cmd_run removes it again if the run never wrote to it.
    out, n = base, 1
    while True:
        try:
            out.mkdir(parents=True)
            return out
        except FileExistsError:
            n += 1
            out = base.with_name(f"{base.name}-{n}")


def cmd_run(args: argparse.Namespace, hooks=()) -> int:
    from fedray.runtime.ray_start import shutdown_ray, start_ray_during

    if args.resume:
        cfg, out = _resume_target(args)
    else:
        if not args.config:
            raise ConfigError("config", "give a preset name or a YAML file (or --resume DIR)")
        cfg = _load(args, registries=False)
        out = _output_dir(args, cfg.name)
        args.output_dir = str(out)  # for the resume hint if the run fails

    def prepare():
        # torch, the methods, the round loop and MLflow: imported while Ray starts (when the run is on Ray).
        from fedray.gc_pause import imports_without_gc

        with imports_without_gc():
            from fedray.methods import resolve_experiment
            from fedray.record.run_dir import MLFLOW_RUN_FILE
            from fedray.runtime import make_runtime
            from fedray.simulation import run_experiment
            from fedray.record.provenance import command_line
            from fedray.record.tracking import RunTracking

            if cfg.tracking.enabled:  # MLflow's ~1 s of imports here, frozen with the rest, not in RunTracking
                importlib.import_module("mlflow.tracking")

        experiment = resolve_experiment(cfg)  # the one resolution of this run: config, method, parameters
        # Built before any work: it checks tracking.uri.
        tracking = ([RunTracking(experiment.cfg, run_file=out / MLFLOW_RUN_FILE, resume=bool(args.resume),
                                 source=command_line(getattr(args, "argv", [])))]
                    if experiment.cfg.tracking.enabled else [])
        return experiment, make_runtime, run_experiment, tracking

    owns_ray = False  # a Ray started here and not yet handed to a runtime
    try:
        (experiment, make_runtime, run_experiment, tracking), owns_ray = start_ray_during(cfg, prepare)
        runtime, owns_ray = make_runtime(experiment, owns_ray=owns_ray), False  # the runtime shuts it down now
        result = run_experiment(experiment, out, progress=not args.no_progress, hooks=[*tracking, *hooks],
                                resume_from=out if args.resume else None, runtime=runtime)
    finally:
        shutdown_ray(owns_ray)  # started above for a run that failed before its runtime took Ray over
        if not args.resume and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # made by _output_dir for a run that failed before writing anything
    cfg = experiment.cfg
    from fedray.record.console import make_console, summary_table
    from fedray.record.run_dir import HISTORY_FILE, SUMMARY_FILE

    console = make_console()
    console.print(summary_table(result.summary, title=f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}"))
    console.print(f"results in {out}/ ({SUMMARY_FILE}, {HISTORY_FILE})")
    if tracking:
        from fedray.record.tracking import ui_hint

        console.print(ui_hint(tracking[0].tracker.uri, tracking[0].tracker.experiment_id,
                              tracking[0].started_run_id), highlight=False, soft_wrap=True)
    return 0


def _resume_target(args: argparse.Namespace):
    from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE, CheckpointError, load_checkpoint
    from fedray.load import validate_config
    from fedray.overrides import apply_overrides
    from fedray.record.run_dir import SUMMARY_FILE, is_finished
    from fedray.simulation import check_resumable

    out = Path(args.resume)
    if args.output_dir and Path(args.output_dir) != out:
        raise ConfigError("--output-dir", "a resumed run continues in its own directory; drop --output-dir")
    finished = is_finished(out)
    if finished and not (out / CHECKPOINT_FILE).is_file():
        raise CheckpointError("--resume", f"{out} holds a finished run ({SUMMARY_FILE}) without a checkpoint "
                              "(runtime.checkpoint_every=0): nothing to resume or extend")
    ckpt = load_checkpoint(out)
    if args.config and "=" not in args.config:
        # The command as first typed, with --resume added: CONFIG and its overrides must resolve to the checkpoint's
        # experiment (runtime.*, tracking.* and where the data is read from may differ), refused now, before Ray starts.
        cfg = _load(args, registries=False)
    else:  # --resume DIR [key=value ...]: the checkpoint's config with these overrides
        overrides = ([args.config] if args.config else []) + list(args.overrides)
        if args.data_dir:
            overrides.append(f"data.data_dir={args.data_dir}")
        cfg = validate_config(apply_overrides(ckpt["config"], overrides))  # the registries' checks: in cmd_run
    if finished and cfg.federation.rounds <= ckpt["round"]:
        raise CheckpointError("--resume", f"{out} holds a finished run of {ckpt['round']} rounds ({SUMMARY_FILE}); "
                              "to extend it, add federation.rounds=N with N above that")
    check_resumable(cfg, ckpt)
    return cfg, out


def cmd_partition(args: argparse.Namespace) -> int:
    from fedray.record.console import comparison_table, make_console
    from fedray.data import build_federated_data
    from fedray.data.plot import partition_label, partition_summary, plot_partition

    cfg = _load(args)
    if args.plot:
        _check_plot("--plot", args.plot)
    fd = build_federated_data(cfg.data, cfg.seed)
    rows = partition_summary(fd)
    labels = [str(c) for c in range(fd.num_classes)] if fd.num_classes <= 20 else []
    for row in rows:
        row.update(zip(labels, row["label_counts"]))
    columns = ["client", *(["domain"] if fd.domains else []), "train", "test", *labels, "num_labels",
               "dominant_share"]
    title = f"{cfg.data.dataset}, {partition_label(cfg.data)}, {fd.num_clients} clients"
    if fd.server is not None:
        title += f"; server: {len(fd.server.y)} {'labelled' if fd.server.labelled else 'unlabelled'} samples" + (
            f" of domain {fd.server.domain}" if fd.server.domain else "")
    if fd.num_val:
        title += f"; validation: {fd.num_val} samples"
    console = make_console()
    console.print(comparison_table(rows[:MAX_TABLE_ROWS], columns, title=title + " (label columns: samples)"))
    if len(rows) > MAX_TABLE_ROWS:
        console.print(f"... {len(rows) - MAX_TABLE_ROWS} more clients not shown")
    if args.plot:
        path = plot_partition(fd, args.plot, title=title)
        print(f"plot written to {path}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from fedray.load import load_config
    from fedray.record.console import comparison_table, make_console
    from fedray.data.datasets import input_spec
    from fedray.models import describe_models

    overrides = list(args.overrides) + ([f"data.dataset={args.dataset}"] if args.dataset else [])
    cfg = load_config(args.config, overrides)
    shape, classes = input_spec(cfg.data)
    rows = describe_models(shape, classes)
    for row in rows:
        row["model.name"] = row["name"]
        row["parameters"] = f"{row['parameters']:,}" if row["parameters"] is not None else None
        row["note"] = row["error"] or row["description"]
    title = f"model zoo for {cfg.data.dataset}: {'x'.join(map(str, shape))} images, {classes} classes"
    make_console().print(comparison_table(rows, ["model.name", "parameters", "feature_dim", "note"], title=title))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from fedray.sweep.spec import check_repeats, load_spec

    for flag in ("num_samples", "max_concurrent"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError("--" + flag.replace("_", "-"), f"must be at least 1 (got {value})")
    spec = load_spec(args.spec)
    check_repeats(spec, args.num_samples, "--num-samples" if args.num_samples else "num_samples")
    _check_writable("storage", Path(spec.storage).expanduser(), folder=True)
    from fedray.sweep.command import tune

    return tune(spec, args)


def cmd_report(args: argparse.Namespace) -> int:
    if args.clients is not None or args.events is not None:
        from fedray.report.views import report_clients, report_events

        return report_clients(args, _check_plot) if args.clients is not None else report_events(args)
    from fedray.report import report

    if args.out:
        _check_writable("--out", Path(args.out), folder=False)
    if args.plot:
        _check_plot("--plot", args.plot)
    markdown = report(args.runs, args.experiment, args.tracking_uri,
                      by_method=tuple(k for k in args.by_method.split(",") if k),
                      by_setting=tuple(k for k in args.by_setting.split(",") if k),
                      target=args.target, out=args.out, plot=args.plot)
    print(markdown)
    if args.plot:
        print(f"learning curves written to {args.plot}")
    return 0


def main(argv: list[str] | None = None, hooks=()) -> int:
    """The console script; ``hooks`` are passed to ``fedray run``'s :func:`~fedray.simulation.run_experiment`."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in parser.commands:
        # Options may come between overrides: fedray run quickstart --output-dir d seed=1
        args = parser.commands[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = parser.parse_args(argv)
    args.argv = argv  # the command as typed: MLflow's Source of the runs it starts
    clear_interrupted()
    from fedray.paths import anchor_path_env

    anchor_path_env()
    if threading.current_thread() is threading.main_thread():
        # A scheduler's SIGTERM (preemption, `kill`) ends the run like Ctrl-C: MLflow run KILLED, not RUNNING.
        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGINT, interrupt)
    try:
        commands = {"run": lambda a: cmd_run(a, hooks), "partition": cmd_partition, "tune": cmd_tune,
                    "report": cmd_report, "models": cmd_models}
        return commands[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailure as e:
        out = (args.resume or args.output_dir) if args.command == "run" else None
        from fedray.record.checkpoint import FILENAME

        # only a command that can work: a checkpoint to resume from, and a cause a resume does not meet again
        can = out and e.resumable and (Path(out) / FILENAME).is_file()
        hint = f"; continue from the last checkpoint with: fedray run --resume {out}" if can else ""
        print(f"error: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = f"; continue with: fedray tune {args.spec} --resume" if args.command == "tune" else ""
        print("interrupted" + hint, file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
