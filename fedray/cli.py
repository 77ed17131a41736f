"""``fedray run | partition``: the command line.

A mistake the user can fix (config, data path, resources) ends with one line on stderr naming the key
and what is allowed, and exit status 2; no traceback and no result files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedray.errors import ConfigError, UserError

EXIT_USAGE = 2
MAX_TABLE_ROWS = 100


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        print(f"error: {message} (see 'fedray {self.prog.split()[-1]} --help')", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a preset name (e.g. quickstart) or a YAML file")
    p.add_argument("overrides", nargs="*", help="dotted overrides: data.alpha=0.5 federation.rounds=10 ...")
    p.add_argument("--data-dir", help="dataset root (torchvision layout); sets data.data_dir")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedray", description="Federated learning and distillation simulator on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one experiment and print its result table")
    _add_config_args(run)
    run.add_argument("--output-dir", help="where summary.json and history.parquet go (default runs/NAME-TIME)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    part = sub.add_parser("partition", help="print per-client sample counts; optionally plot them")
    _add_config_args(part)
    part.add_argument("--plot", help="write the client-by-label bubble plot (FedKF Fig. 4) to this PNG")
    return parser


def _load(args: argparse.Namespace):
    from fedray.config import load_config

    overrides = list(args.overrides)
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    return load_config(args.config, overrides)


def _output_dir(args: argparse.Namespace, name: str) -> Path:
    out = Path(args.output_dir) if args.output_dir else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and not out.is_dir():
        raise ConfigError("--output-dir", f"{out} exists and is not a directory; choose another path")
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from fedray.simulation import run_experiment
    from fedray.tracking import make_console, summary_table

    cfg = _load(args)
    out = _output_dir(args, cfg.name)
    result = run_experiment(cfg, out, progress=not args.no_progress)
    console = make_console()
    console.print(summary_table(result.summary, title=f"{cfg.name}: {cfg.algorithm.name} on {cfg.data.dataset}"))
    console.print(f"results in {out}/ (summary.json, history.parquet)")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from fedray.data import build_federated_data
    from fedray.data.plot import partition_summary, plot_partition
    from fedray.tracking import comparison_table, make_console

    cfg = _load(args)
    fd = build_federated_data(cfg.data, cfg.seed)
    rows = partition_summary(fd)
    labels = [str(c) for c in range(fd.num_classes)] if fd.num_classes <= 20 else []
    for row in rows:
        row.update(zip(labels, row["label_counts"]))
    columns = ["client", "train", "test", *labels, "num_labels", "dominant_share"]
    title = f"{cfg.data.dataset}, {cfg.data.partition} (alpha={cfg.data.alpha:g}), {fd.num_clients} clients"
    console = make_console()
    console.print(comparison_table(rows[:MAX_TABLE_ROWS], columns, title=title + " (label columns: samples)"))
    if len(rows) > MAX_TABLE_ROWS:
        console.print(f"... {len(rows) - MAX_TABLE_ROWS} more clients not shown")
    if args.plot:
        path = plot_partition(fd, args.plot, title=title)
        print(f"plot written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"run": cmd_run, "partition": cmd_partition}[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
