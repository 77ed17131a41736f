"""``fedray report --clients RUN`` and ``--events RUN``: one finished run's clients, printed (and plotted), from its
``clients.parquet`` or ``events.parquet``. Each refuses the options of the runs' table in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedray.errors import ConfigError


def _one_run(args: argparse.Namespace, flag: str, what: str, extra: tuple[tuple[str, object], ...] = ()) -> None:
    given = [name for name, value in (("RUNS", args.runs), ("--experiment", args.experiment),
                                      ("--target", args.target), ("--out", args.out), *extra) if value]
    if given:
        raise ConfigError(flag, f"reports one run's {what}, so {', '.join(given)} cannot come with it; report the "
                          f"runs' table without {flag}")


def report_clients(args: argparse.Namespace, check_plot) -> int:
    """The table of the run's client spread, and its plot (``--plot``, default RUN/clients.png, checked by
    ``check_plot(option, path)`` before any work)."""
    from fedray.record.console import comparison_table, make_console
    from fedray.record.run_dir import CLIENTS_PLOT_FILE
    from fedray.report.clients import (TABLE_COLUMNS, client_history_path, most_often_worst, plot_client_spread,
                                       round_spreads, run_title, shown_rounds, table_rows)

    _one_run(args, "--clients", "clients")
    path = client_history_path(args.clients)
    plot = args.plot or str(Path(args.clients) / CLIENTS_PLOT_FILE)
    check_plot("--plot", plot)
    spreads = round_spreads(path)
    shown = shown_rounds(spreads)
    title = run_title(args.clients, spreads[-1].clients)
    some = f" ({len(shown)} of {len(spreads)} evaluated rounds)" if len(shown) < len(spreads) else ""
    console = make_console()
    console.print(comparison_table(table_rows(shown), TABLE_COLUMNS, title=title + some))
    client, times = most_often_worst(spreads)
    console.print(f"client {client} was the worst at {times} of {len(spreads)} evaluated round(s)", highlight=False)
    written = plot_client_spread(spreads, plot, title=title)
    console.print(f"client spread plotted to {written}", highlight=False, soft_wrap=True)
    return 0


def report_events(args: argparse.Namespace) -> int:
    """Per round, what became of the clients selected (events.parquet)."""
    from fedray.record.console import comparison_table, make_console
    from fedray.report.events import COLUMNS, event_rows, events_path

    _one_run(args, "--events", "events", (("--plot", args.plot),))
    rows = event_rows(events_path(args.events))
    make_console().print(comparison_table(rows, COLUMNS, title=f"{args.events}: the clients of each round"))
    return 0


__all__ = ["report_clients", "report_events"]
