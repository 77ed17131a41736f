"""What compression costs a round: the `quickstart` preset (FedAvg, LeNet-5 on real Fashion-MNIST, 20 clients, 8 a
round) in process, one torch thread, with the channel off and with each compression setting of ``--settings``, its
clients trained one by one and vectorised (``runtime.vectorize=true``: in lockstep, as on a GPU).

Two figures per setting: the channel's own time in a round (the server encoding the payload, the worker decoding it
once for its task, the 8 uploads encoded stacked, one row a client, as the worker does in both modes, the server
decoding them: timed directly on the run's messages, median of ``--repeats``), as a share of the plain run's median
round in each mode; and the runs' median rounds (wall time less evaluation), which carry the machine's noise. Prints a Markdown table and writes it with the JSON rows to ``--out``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/compression.py --out benchmarks/results/compression
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedray.channel.channel import build_channel
from fedray.data import build_federated_data
from fedray.load import load_config
from fedray.methods import resolve_experiment
from fedray.runtime.local import LocalRuntime
from fedray.simulation import run_experiment

from overhead import _cpu_name  # benchmarks/speed/ is the script's folder, first on sys.path

SETTINGS = {
    "qsgd8": ["channel.quantize=qsgd", "channel.bits=8"],
    "qsgd8-both": ["channel.quantize=qsgd", "channel.bits=8", "channel.compress_on=both"],
    "top1-ef": ["channel.sparsify=topk", "channel.fraction=0.01", "channel.error_feedback=true"],
    "rand1-ef": ["channel.sparsify=randk", "channel.fraction=0.01", "channel.error_feedback=true"],
    "top1-ef-qsgd8-both": ["channel.sparsify=topk", "channel.fraction=0.01", "channel.error_feedback=true",
                           "channel.quantize=qsgd", "channel.bits=8", "channel.compress_on=both"],
}
BASE = ["runtime.num_cpus_per_worker=1", "tracking.enabled=false", "federation.eval_every=1000"]
MODES = {"one by one": ["runtime.vectorize=false"], "vectorised": ["runtime.vectorize=true"]}


def channel_seconds(overrides: list[str], repeats: int) -> float:
    """The channel's work of one round on the run's own messages: the payload encoded once and decoded once (one
    worker task), 8 uploads (trained once, plain) encoded against it with their residuals and decoded at the
    server."""
    cfg = load_config("quickstart", BASE + overrides)
    exp = resolve_experiment(cfg)
    channel = build_channel(cfg)
    data = build_federated_data(cfg.data, cfg.seed)
    with LocalRuntime(load_config("quickstart", BASE), data) as rt:
        clients = list(range(cfg.federation.clients_per_round))
        rt.run_round(1, clients)
        payload = rt.server.algo.broadcast(rt.server.state, 2)
        uploads = [u for u, *_ in rt.worker.train_many(2, clients, payload, [None] * len(clients))]
    del exp
    times = []
    states = {c: channel.init_state(c) for c in clients}
    server = channel.init_server_state()
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        sent, server = channel.encode_down(payload, r, server)
        decoded = channel.decode_down(sent)  # once per worker task, as the runtime does (in process: one task)
        encoded = channel.encode_up_many(uploads, decoded, [states[c] for c in clients], clients, r + 1)
        for c, (packet, states[c]) in zip(clients, encoded):
            channel.decode_up(packet, decoded)
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_round(overrides: list[str], rounds: int) -> tuple[float, dict]:
    cfg = load_config("quickstart", BASE + [f"federation.rounds={rounds}"] + overrides)
    result = run_experiment(cfg, progress=False)
    rows = result.history[1:]  # round 1 carries the start-up
    return statistics.median(r["time/round_s"] - r["time/eval_s"] for r in rows), result.summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    own = {name: channel_seconds(SETTINGS[name], args.repeats) for name in args.settings}
    rows = []
    for mode, flags in MODES.items():
        plain, summary = median_round(flags, args.rounds)
        rows.append({"setting": "off", "clients": mode, "round_s": plain, "channel_s": 0.0, "share": 0.0,
                     "mb_up": summary["comm/bytes_up"] / 1e6, "mb_down": summary["comm/bytes_down"] / 1e6})
        for name in args.settings:
            round_s, summary = median_round(flags + SETTINGS[name], args.rounds)
            rows.append({"setting": name, "clients": mode, "round_s": round_s, "channel_s": own[name],
                         "share": own[name] / plain, "mb_up": summary["comm/bytes_up"] / 1e6,
                         "mb_down": summary["comm/bytes_down"] / 1e6})
    lines = [f"CPU: {_cpu_name()}, one torch thread; quickstart (FedAvg, LeNet-5, Fashion-MNIST, 8 clients a round), "
             f"{args.rounds} rounds (median of rounds 2..), channel timed {args.repeats} times", "",
             "| setting | clients | median round (s) | channel in a round (s) | channel / plain round | MB up | MB down |",
             "| :--- | :--- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['setting']} | {r['clients']} | {r['round_s']:.3f} | {r['channel_s']:.4f} | "
              f"{100 * r['share']:.2f} % | {r['mb_up']:.2f} | {r['mb_down']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
