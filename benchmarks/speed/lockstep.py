"""How the vectorised lockstep batches ``gpu.py``'s DaFKD workload, measured on a CPU: vmapped calls a step and
steps replayed from a CUDA graph, with short batches padded or not.

At alpha = 0.1 almost every lockstep step of 32 clients holds a short batch (a client's pass over its data ending),
and DaFKD's modules have BatchNorm (its DCGAN generator's at least), so an unpadded step splits into one vmapped call
per batch length. ``runtime.vectorize_pad`` pads such a round instead, its BatchNorm layers normalising by the real
rows (``fedray.vectorized.engine.PAD_BATCHNORM_FROM``). Which it is, and how much of the round a graph replays,
does not depend on the device: here the CUDA graph path runs with the tests' stand-in for a capture (a "replay"
runs the captured step's Python again), so "graph steps" is the share a GPU would replay, and the seconds are this
CPU's, not a GPU's. The classifier is LeNet-5 in place of ``gpu.py``'s ResNet-11: the batches, the noise and the
updates' flags, which decide the grouping, are the same.

Setting: ``gpu.py``'s (synthetic 1x28x28 data, 60,000 images, alpha = 0.1, 2.5x as many clients as per round, 20
local steps of 32), DaFKD without its ``diag/*`` probe, one torch thread, ``--rounds`` rounds. ``--epochs E``: E
local epochs instead of 20 steps (as DaFKD's paper budget, E = 20, has it): clients hold unequal data, so they are
done after unequal numbers of steps (the lockstep's phases, ``fedray.vectorized.phases.in_phases``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/lockstep.py [--per-round 8 32] [--rounds 2] [--epochs 1]

Writes ``OUT/lockstep.{json,md}`` (``lockstep_e<E>.*`` with ``--epochs``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fedray.learning import cuda_graphs
from fedray.load import load_config
from fedray.simulation import run_experiment

SETTING = ["data.dataset=synthetic", "data.synthetic_image_size=28", "data.synthetic_train_samples=60000",
           "data.alpha=0.1", "federation.local_steps=20", "federation.batch_size=32", "tracking.enabled=false",
           "algorithm.name=dafkd", "model.name=lenet5", "algorithm.diag_samples=0", "runtime.device=cpu",
           "runtime.vectorize=true"]


def graphs_on_cpu() -> None:
    """The CUDA graph path on a CPU, a "capture" being the step's body, rerun at each "replay"."""
    cuda_graphs.GRAPH_DEVICES = ("cuda", "cpu")
    cuda_graphs.capture = lambda body, stream: body


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--per-round", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=None, help="local epochs instead of 20 local steps")
    ap.add_argument("--pad", nargs="+", default=["false", "true"], choices=["false", "true"],
                    help="runtime.vectorize_pad values to run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    graphs_on_cpu()
    setting = SETTING + ([f"federation.local_epochs={args.epochs}"] if args.epochs else [])
    record = {"benchmark": "lockstep", "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "setting": setting, "rows": []}
    for k in args.per_round:
        for pad in (p == "true" for p in args.pad):
            overrides = setting + [f"federation.rounds={args.rounds}", f"federation.eval_every={args.rounds}",
                                   f"data.num_clients={int(2.5 * k)}", f"federation.clients_per_round={k}",
                                   f"runtime.vectorize_pad={str(pad).lower()}"]
            cfg = load_config(None, dict(o.split("=", 1) for o in overrides))
            history = run_experiment(cfg, progress=False).history
            row = {"clients": k, "pad": pad, "per_round": [
                {"groups_per_step": r["vec/groups_per_step"], "graph_steps": r["vec/graph_steps"],
                 "round_s": r["time/round_s"]} for r in history]}
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"lockstep_e{args.epochs}" if args.epochs else "lockstep"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    budget = f"{args.epochs} local epoch{'s' * (args.epochs != 1)}" if args.epochs else "20 local steps"
    lines = [f"# The lockstep of gpu.py's DaFKD workload, {budget}, on a CPU ({record['date']}, torch {record['torch']})",
             "", "LeNet-5 for ResNet-11, CUDA graphs by the CPU stand-in; per round: vmapped calls a step, share of the "
             "steps replayed from a graph, seconds (this CPU's).", "",
             "| clients/round | short batches | vmap calls/step | graph steps | s/round |", "| ---: | --- | --- | --- | --- |"]
    for r in record["rows"]:
        cells = [" / ".join(f"{p[key]:{fmt}}" for p in r["per_round"])
                 for key, fmt in (("groups_per_step", ".2f"), ("graph_steps", ".0%"), ("round_s", ".1f"))]
        lines.append(f"| {r['clients']} | {'padded' if r['pad'] else 'own calls'} | " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
