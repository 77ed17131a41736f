"""Host-side work of a local step, counted on a CPU: the ops the host issues per step of a round's clients.

On a GPU, the small models of ``gpu.py`` are host-bound: each top-level op is a kernel launch (or host-side
bookkeeping) that the Python thread has to issue, and the GPU idles between them. This counts them on the CPU,
where no GPU is needed: ``torch.profiler``'s top-level ``aten::`` ops (an op called by another op is not
counted again) per step of all K clients of a round, for

- ``sequential``: the clients one at a time (K client-steps);
- ``vectorised``: one lockstep step of the K clients (``runtime.vectorize=true``);
- ``vectorised, unpadded``: the same with ``runtime.vectorize_pad=false`` (short batches as calls of their own).

Same workloads as ``gpu.py`` (synthetic 1x28x28 data the size of Fashion-MNIST, alpha = 0.1, 20 local SGD
steps of 32, 2.5K clients, K per round); round 1 warms up, round 2 is counted. "Per round" is what the round
costs outside its steps (building the schedule, stacking weights, the uploads), of which "server" is the server's
aggregation (host tensors, no kernel launches even on a GPU). "vmap calls/step" is
``vec/groups_per_step``. DaFKD's server distillation is cut to one short step (it is not a client step).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/host_ops.py [--rows lenet5:8 lenet5:32 resnet8:8]
        [--variants sequential vectorised "vectorised, unpadded"]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/host_ops.py --rows dafkd:8 --name host_ops_dafkd   # ~30 min

Writes ``benchmarks/results/host_ops.{json,md}`` (``--out``, ``--name`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).parent))
import gpu  # noqa: E402  (the workloads of the GPU benchmark)

from fedray.methods import validate_experiment  # noqa: E402
from fedray.methods.api import ClientContext  # noqa: E402
from fedray.load import load_config  # noqa: E402
from fedray.data import build_federated_data  # noqa: E402
from fedray.runtime import make_runtime  # noqa: E402
from fedray.vectorized import engine as vectorized  # noqa: E402
from fedray.runtime.server_core import ServerCore  # noqa: E402
from fedray.seeding import sample_clients  # noqa: E402

STEP = "host_ops/step"
SERVER = "host_ops/server"
WORKLOADS = {"lenet5": "fedavg_lenet5", "resnet8": "fedavg_resnet8", "dafkd": "dafkd_resnet11"}
# DaFKD's server distillation (100 steps of 1,024 generated images through 8 ResNet-11 teachers) takes minutes a
# round on a CPU and runs outside the clients' steps counted here: cut short
SHORTER = {"dafkd": ["algorithm.distill_steps=1", "algorithm.distill_samples=64"]}
VARIANTS = {"sequential": ["runtime.vectorize=false"], "vectorised": ["runtime.vectorize=true"],
            "vectorised, unpadded": ["runtime.vectorize=true", "runtime.vectorize_pad=false"]}


def _marked(steps):
    """``steps`` (an iterator of local steps) with each step, from producing its inputs to asking for the next,
    inside a profiler range."""
    it = iter(steps)
    while True:
        with record_function(STEP):
            try:
                item = next(it)
            except StopIteration:
                return
            yield item


def count(overrides: list[str], k: int) -> dict:
    cfg = validate_experiment(load_config(None, overrides))
    data = build_federated_data(cfg.data, cfg.seed)
    with make_runtime(cfg, data) as rt:
        rt.run_round(1, sample_clients(cfg.seed, 1, data.num_clients, k))
        clients = sample_clients(cfg.seed, 2, data.num_clients, k)
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = rt.run_round(2, clients)
        seconds = time.perf_counter() - t
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]

    def range_of(e, name):
        while e is not None and e.name != name:
            e = e.cpu_parent
        return e

    owners = [range_of(e, STEP) for e in top]
    stepped = sum(o is not None for o in owners)
    server = sum(range_of(e, SERVER) is not None for e in top)
    marks = len({id(o) for o in owners if o is not None})  # steps that ran ops (not the final, empty next())
    vectorised = "runtime.vectorize=true" in overrides
    # a lockstep step is one mark per worker; sequentially each client's step is one, K of them a round step
    round_steps = marks if vectorised else marks / k
    groups = [i["vec/groups_per_step"] for i in out.client_infos if "vec/groups_per_step" in i]
    return {"ops_per_step": stepped / max(round_steps, 1), "ops_per_round_outside_steps": len(top) - stepped,
            "server_ops_per_round": server,
            "steps": round_steps, "groups_per_step": groups[0] if groups else None, "profiled_round_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", default=["lenet5:8", "lenet5:32", "resnet8:8"],
                    help="workload:clients-per-round, workloads " + ", ".join(WORKLOADS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "results"))
    ap.add_argument("--name", default="host_ops", help="file name of the results (OUT/NAME.json, OUT/NAME.md)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # mark the steps: the sequential runner's batches, or the lockstep's steps (one level only: a client's batches
    # drawn inside a lockstep step would open ranges that outlive it)
    batches, lockstep = ClientContext.batches, vectorized._lockstep
    aggregate = ServerCore.aggregate

    def marked_aggregate(self, *args):
        with record_function(SERVER):
            return aggregate(self, *args)

    ServerCore.aggregate = marked_aggregate

    def mark(vectorised: bool) -> None:
        ClientContext.batches = batches if vectorised else (lambda self: _marked(batches(self)))
        vectorized._lockstep = (lambda plans: _marked(lockstep(plans))) if vectorised else lockstep

    rows = []
    for spec in args.rows:
        wl, k = spec.split(":")
        common = gpu.BASE + gpu.WORKLOADS[WORKLOADS[wl]] + [
            "federation.rounds=2", f"data.num_clients={int(2.5 * int(k))}", f"federation.clients_per_round={k}",
            "runtime.device=cpu", *SHORTER.get(wl, [])]
        for variant in args.variants:
            extra = VARIANTS[variant]
            mark(variant != "sequential")
            row = {"workload": WORKLOADS[wl], "clients_per_round": int(k), "variant": variant,
                   **count(common + extra, int(k))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, torch {torch.__version__}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    (out / f"{args.name}.json").write_text(json.dumps({"machine": machine, "commit": commit,
                                                   "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    lines = [f"# Host ops per local step of a round's clients ({machine}, commit {commit}, "
             f"{time.strftime('%Y-%m-%d %H:%M')})", "",
             "| workload | K | variant | ops per step of K clients | vmap calls/step | ops per round outside steps "
             "| of which server |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        g = "" if r["groups_per_step"] is None else f"{r['groups_per_step']:.2f}"
        lines.append(f"| {r['workload']} | {r['clients_per_round']} | {r['variant']} | {r['ops_per_step']:.0f} | {g} "
                     f"| {r['ops_per_round_outside_steps']} | {r['server_ops_per_round']} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
