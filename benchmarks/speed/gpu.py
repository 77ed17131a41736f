"""Throughput on a GPU: per-round time and GPU busy fraction, sequential against vectorised clients.

Rows (synthetic 1x28x28 data, Dirichlet alpha=0.1, 20 local SGD steps of batch 32, ``--rounds`` rounds, the
mean over rounds 2..R-1: round 1 pays one-off start-up, round R the evaluation): FedAvg with LeNet-5 and with
ResNet-8, and DaFKD with ResNet-11 (its classifier/discriminator and generator updates batched), each
in-process and on Ray with fractional GPUs (4 workers x 0.2 GPU, server 0.2), with the clients sequential
(``runtime.vectorize`` false, ``runtime.cuda_graphs`` at its default, true: the server replays its distillation
steps as in the graphed rows), vectorised (``runtime.cuda_graphs`` false: the server's steps eager too) and
vectorised with CUDA graphs (``--modes`` picks). "speed-up" is over the sequential row. "of it server" is the mean ``time/server_s``, the server's aggregation (DaFKD's
distillation). The GPU's busy fraction is ``nvidia-smi``'s utilization.gpu sampled every 200 ms from the end
of round 1. "vmap calls/step" (vectorised rows) is the runs' ``vec/groups_per_step``: vmapped calls per
lockstep step, 1 when all of a worker's clients ran as one; "graph steps" the share of steps replayed from a
CUDA graph (``vec/graph_steps``).
Targets (issue 13): vectorised in-process >= 5x faster than sequential, and >= 80 % busy.

``--graph-check``: before the rows, one round of 8 clients of FedAvg (LeNet-5; ResNet-8 with momentum and
weight decay; ResNet-8 with BatchNorm; LeNet-5 with Adam), FedProx, DaFKD (ResNet-11: the clients' two updates
a step and the server's distillation), FedKF (LeNet-5: the student's and the generator's updates) and, with 32
clients, FedAvg on ResNet-8 with BatchNorm (unpadded: a masked graph; padded) and DaFKD (padded), eager, with CUDA
graphs, and eager again, from one seed, with
cuDNN's default algorithms and with ``cudnn.deterministic``: the largest weight difference of graphs against
eager and of eager against eager (what the GPU's own non-determinism gives), in a table of ``OUT/gpu.md``.

``--profile``: after the table, each in-process FedAvg row is run once more for 3 rounds with round 2 under
``torch.profiler`` (CPU and CUDA activity), for where a round's time goes: its top-level ``aten::`` ops, the GPU's
kernels and copies, calls that make the host wait for the GPU (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, ``cudaMemcpy``), ``cudaMemcpyAsync`` calls, and the
kernels' summed time over the profiled round's wall time (the profiler slows the host, so this share is a
lower bound). Written to ``OUT/gpu_profile.json`` and a second table in ``OUT/gpu.md``. DaFKD rows are left
out: a trace of their rounds holds millions of events.

    python benchmarks/speed/gpu.py --out results/gpu [--rounds 6] [--per-round 8 32] [--ray-per-round 8] [--no-ray] [--profile]
                             [--modes sequential vectorised graphs] [--graph-check [RUN ...]]
    .venv/bin/python benchmarks/speed/gpu.py --device cpu --rounds 2 --per-round 4 --no-ray --out /tmp/g --profile  # dry run

Writes ``OUT/gpu.json`` and ``OUT/gpu.md`` (one table, the device named) after every row, so a run cut off by
a time limit still leaves the rows it finished (the table's title says "partial" until the last row); a row
that fails records its error and the next one runs.
Ray rows need Ray on the machine (``../shared/GPU.md``: the bundle script); without it they are skipped and
the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import torch

from fedray.load import load_config
from fedray.simulation import run_experiment

# Fashion-MNIST's 60,000 training images (the synthetic default, 100 per client, gives most clients short
# batches every few steps: each splits a lockstep step into one more vmapped call, see ``vec/groups_per_step``)
BASE = ["data.dataset=synthetic", "data.synthetic_image_size=28", "data.synthetic_train_samples=60000",
        "data.alpha=0.1", "federation.local_steps=20",
        "federation.batch_size=32", "tracking.enabled=false"]
WORKLOADS = {
    "fedavg_lenet5": ["algorithm.name=fedavg", "model.name=lenet5"],
    "fedavg_resnet8": ["algorithm.name=fedavg", "model.name=resnet8"],
    "dafkd_resnet11": ["algorithm.name=dafkd", "model.name=resnet11"],
    # without the simulation-only diagnostics of Eq. 7 (diag/*: every upload on 100 of each client's images and
    # 1,000 test images, every round), which are not DaFKD's work but scale with the clients
    "dafkd_resnet11_nodiag": ["algorithm.name=dafkd", "model.name=resnet11", "algorithm.diag_samples=0"],
    # one local epoch instead of 20 steps (the paper budget's shape, E = 20 epochs, cut 20x): clients of unequal data
    # are done after unequal numbers of steps (15-116 here), so the vectorised round runs in phases
    "dafkd_resnet11_e1": ["algorithm.name=dafkd", "model.name=resnet11", "algorithm.diag_samples=0",
                          "federation.local_epochs=1"],
    # runtime.precision=bf16: the clients' convolutions and linear layers on bfloat16 copies (its sequential row too)
    "dafkd_resnet11_nodiag_bf16": ["algorithm.name=dafkd", "model.name=resnet11", "algorithm.diag_samples=0",
                                   "runtime.precision=bf16"],
}
RAY = ["runtime.backend=ray", "runtime.num_workers=4", "runtime.num_gpus_per_worker=0.2", "runtime.server_num_gpus=0.2"]


class BusySampler(threading.Thread):
    """``nvidia-smi``'s GPU utilization (%) every 200 ms, kept only while ``recording`` is set."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.recording = threading.Event()
        self._halt = threading.Event()
        self.available = True

    def run(self) -> None:
        while not self._halt.wait(0.2):
            if not self.recording.is_set():
                continue
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append(float(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                self.available = False

    def stop(self) -> None:
        self._halt.set()
        self.join()


class RecordAfterRound1:
    """A run hook: start recording GPU utilization once round 1 has ended."""

    def __init__(self, sampler: BusySampler):
        self.sampler = sampler

    def on_start(self, cfg, data) -> None:
        pass

    def on_round(self, row: dict) -> None:
        self.sampler.recording.set()  # from the end of round 1 on

    def on_end(self, result) -> None:
        self.sampler.recording.clear()

    def on_error(self, exc: BaseException) -> None:
        self.sampler.recording.clear()


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class ProfileRound2:
    """A run hook: ``torch.profiler`` over round 2 (started when round 1 ends, stopped when round 2 does)."""

    def __init__(self, device: str):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        self.prof, self.rounds, self.wall = profile(activities=activities), 0, 0.0

    def on_start(self, cfg, data) -> None:
        pass

    def on_round(self, row: dict) -> None:
        self.rounds += 1
        if self.rounds == 1:
            self.prof.start()
            self.t0 = time.perf_counter()
        elif self.rounds == 2:
            self.prof.stop()
            self.wall = time.perf_counter() - self.t0

    def on_end(self, result) -> None:
        pass

    def on_error(self, exc: BaseException) -> None:
        pass

    def figures(self) -> dict:
        events = self.prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        top = [e for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
        kernel_s = sum(e.device_time for e in kernels) / 1e6  # device_time: microseconds
        return {"round_wall_s": self.wall, "aten_ops": len(top), "kernels": len(kernels),
                "waits": sum(e.name in WAITS for e in events),
                "memcpy_async": sum(e.name == "cudaMemcpyAsync" for e in events),
                "kernel_time_share": kernel_s / self.wall if kernels and self.wall else None}


MODES = {"sequential": "sequential", "vectorised": "vectorised", "graphs": "vectorised, CUDA graphs"}
GRAPH_CHECKS = {  # FedAvg as gpu.py runs it, with momentum and weight decay, FedProx, and BatchNorm running stats
    "fedavg lenet5": ["algorithm.name=fedavg", "model.name=lenet5"],
    "fedavg resnet8, momentum 0.9, weight decay 1e-4": ["algorithm.name=fedavg", "model.name=resnet8",
                                                         "federation.momentum=0.9", "federation.weight_decay=1e-4"],
    "fedprox lenet5, mu 0.1": ["algorithm.name=fedprox", "algorithm.mu=0.1", "model.name=lenet5"],
    "fedavg resnet8_bn, batch 50": ["algorithm.name=fedavg", "model.name=resnet8_bn", "federation.batch_size=50"],
    "fedavg lenet5, adam": ["algorithm.name=fedavg", "model.name=lenet5", "federation.optimizer=adam",
                            "federation.lr=0.001"],
    # two updates a step (SGD, then the generator's Adam), host noise, and the server's graphed distillation
    "dafkd resnet11": ["algorithm.name=dafkd", "model.name=resnet11"],
    # two updates a step (the student with SGD, the generator with Adam), host noise (warmup_rounds 0: round 1 distils)
    "fedkf lenet5": ["algorithm.name=fedkf", "model.name=lenet5"],
    # 32 clients of alpha = 0.1 under BatchNorm: most steps split by a short batch. Unpadded, the graph is masked
    # (the replay runs the other clients in a larger vmapped call than the eager step: equal up to rounding, not
    # bits); padded (the default), each step is one call, BatchNorm over the real rows, replayed by a plain graph
    "fedavg resnet8_bn, 32 clients, masked graph": ["algorithm.name=fedavg", "model.name=resnet8_bn",
                                                    "data.num_clients=80", "federation.clients_per_round=32",
                                                    "runtime.vectorize_pad=false"],
    "fedavg resnet8_bn, 32 clients, padded": ["algorithm.name=fedavg", "model.name=resnet8_bn",
                                              "data.num_clients=80", "federation.clients_per_round=32"],
    "dafkd resnet11, 32 clients, padded": ["algorithm.name=dafkd", "model.name=resnet11",
                                           "data.num_clients=80", "federation.clients_per_round=32"],
    # the casts of runtime.precision=bf16 captured with the rest
    "dafkd resnet11, 32 clients, padded, bf16": ["algorithm.name=dafkd", "model.name=resnet11",
                                                 "data.num_clients=80", "federation.clients_per_round=32",
                                                 "runtime.precision=bf16"],
}


def check_graphs(device: str, runs: list[str], deterministic: bool = False) -> list[dict]:
    """Round 1 of 8 clients (or the run's own number) without, with, and again without ``runtime.cuda_graphs``,
    same seed: the global weights compared (a replay runs the eager step's kernels on the same tensors; the eager
    repeat shows how far two eager runs already differ, e.g. by cuDNN's atomics) and the share of steps replayed.
    ``deterministic``: with ``torch.backends.cudnn.deterministic``."""
    from fedray.methods import validate_experiment
    from fedray.data import build_federated_data
    from fedray.runtime import make_runtime
    from fedray.seeding import sample_clients

    def max_diff(a: dict, b: dict) -> float:
        return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if torch.is_floating_point(a[k]))

    out, before = [], torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = deterministic
    for run in runs:
        extra = GRAPH_CHECKS[run]
        try:
            weights, replayed = [], None
            for graphs in (False, True, False):
                cfg = validate_experiment(load_config(None, BASE + [
                    "data.num_clients=20", "federation.clients_per_round=8", f"runtime.device={device}",
                    "runtime.vectorize=true", f"runtime.cuda_graphs={str(graphs).lower()}"] + extra))
                data = build_federated_data(cfg.data, cfg.seed)
                with make_runtime(cfg, data) as rt:
                    k = cfg.federation.clients_per_round
                    infos = rt.run_round(1, sample_clients(cfg.seed, 1, data.num_clients, k)).client_infos
                    weights.append(rt.global_weights())
                if graphs:
                    replayed = float(np.mean([i.get("vec/graph_steps", 0.0) for i in infos]))
            out.append({"run": run, "cudnn_deterministic": deterministic, "graph_steps": replayed,
                        "max_abs_diff": max_diff(weights[0], weights[1]),
                        "eager_repeat_diff": max_diff(weights[0], weights[2]),
                        "identical": all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])})
        except Exception as exc:  # the next check still runs
            out.append({"run": run, "cudnn_deterministic": deterministic, "error": f"{type(exc).__name__}: {exc}"[:500]})
    torch.backends.cudnn.deterministic = before
    return out


def profile_row(name: str, overrides: list[str], device: str) -> dict:
    """One more 3-round run of a row, with round 2 profiled (no evaluation)."""
    hook = ProfileRound2(device)
    cfg = load_config(None, [o for o in overrides if not o.startswith(("federation.rounds=", "federation.eval_every="))]
                      + ["federation.rounds=3", "federation.eval_every=1000"])
    try:
        run_experiment(cfg, progress=False, hooks=[hook])
    except Exception as exc:  # as in run_row: the next row still runs
        return {"row": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"row": name, **hook.figures()}


def run_row(name: str, overrides: list[str]) -> dict:
    cfg = load_config(None, overrides)
    sampler = BusySampler()
    sampler.start()
    t0 = time.perf_counter()
    try:
        result = run_experiment(cfg, progress=False, hooks=[RecordAfterRound1(sampler)])
    except Exception as exc:  # one broken row must not cost the rows after it (device time is scarce)
        return {"row": name, "overrides": overrides, "round_s": None, "busy_pct": None, "accuracy": None,
                "error": f"{type(exc).__name__}: {exc}"[:500], "wall_s": time.perf_counter() - t0}
    finally:
        sampler.stop()
    times = [row["time/round_s"] for row in result.history]
    def mean_of(key: str) -> float | None:
        values = [row[key] for row in result.history[1:-1] or result.history if row.get(key) is not None]
        return float(np.mean(values)) if values else None

    return {"row": name, "overrides": overrides, "round_s": float(np.mean(times[1:-1] or times)), "rounds_s": times,
            "groups_per_step": mean_of("vec/groups_per_step"), "graph_steps": mean_of("vec/graph_steps"),
            "server_s": mean_of("time/server_s"),
            "busy_pct": float(np.mean(sampler.samples)) if sampler.samples and sampler.available else None,
            "accuracy": result.summary.get("eval/accuracy"), "runtime": result.summary.get("runtime"),
            "wall_s": time.perf_counter() - t0}


def profile_rows(record: dict, args: argparse.Namespace) -> None:
    """``--profile``: round 2 of each in-process FedAvg row measured so far, under the profiler."""
    for row in record["rows"]:
        if row["where"] == "in-process" and row["workload"].startswith("fedavg") and not row.get("error"):
            record["profiled"].append({"workload": row["workload"], "clients_per_round": row["clients_per_round"],
                                       "vectorize": row["vectorize"], "graphs": row.get("graphs", False),
                                       **profile_row(row["row"], row["overrides"], args.device)})
            print(json.dumps(record["profiled"][-1]), flush=True)
            write(record, Path(args.out), done=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, nargs="+", default=[8, 32], help="clients per round (of 2.5x as many)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ray-per-round", type=int, nargs="+", default=None,
                    help="clients-per-round values that also get Ray rows (default: all of --per-round)")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also profile round 2 of each in-process FedAvg row")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="sequential clients, vectorised (runtime.cuda_graphs=false), vectorised with CUDA graphs")
    ap.add_argument("--graph-check", nargs="*", default=None, metavar="RUN",
                    help="first: a round with CUDA graphs against one without, weights compared (check_graphs); "
                    "only the runs whose names contain one of RUN, if given")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        import ray  # noqa: F401
        has_ray = not args.no_ray
    except ImportError:
        has_ray = False
    device = torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    record = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d %H:%M"), "device": device,
              "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
              "ray_rows": has_ray, "rows": []}
    rows = record["rows"]
    ray_ks = set(args.per_round if args.ray_per_round is None else args.ray_per_round)
    # in-process rows first (the targets are theirs), Ray rows after: a run cut short loses the Ray rows
    with_ray = has_ray and args.device == "cuda"
    plan = [("in-process", [], k) for k in args.per_round] + [("ray", RAY, k) for k in args.per_round
                                                                 if with_ray and k in ray_ks]
    profiled = record["profiled"] = []
    if args.graph_check is not None:
        runs = [r for r in GRAPH_CHECKS if not args.graph_check or any(w in r for w in args.graph_check)]
        record["graph_check"] = check_graphs(args.device, runs) + check_graphs(args.device, runs, deterministic=True)
        print(json.dumps(record["graph_check"]), flush=True)
        write(record, Path(args.out), done=False)
    for i, (where, extra, k) in enumerate(plan):
        if args.profile and where == "ray" and plan[i - 1][0] != "ray":
            profile_rows(record, args)  # before the Ray rows: the targets are the in-process rows'
        common = BASE + [f"federation.rounds={args.rounds}", f"federation.eval_every={args.rounds}",
                         f"data.num_clients={int(2.5 * k)}", f"federation.clients_per_round={k}",
                         f"runtime.device={args.device}"]
        for wl in args.workloads:
            for mode in args.modes:
                vec, graphs = mode != "sequential", mode == "graphs"
                # The sequential baseline keeps runtime.cuda_graphs at its default, true: its clients have no graph
                # to replay, but its server replays the same distillation steps as the graphed rows', so that the
                # speed-up is the clients' vectorisation alone (until 2026-11-28 it ran them eagerly, 0.4-0.75 s more)
                cuda_graphs = mode != "vectorised"
                name = f"{wl} k={k} {where} {MODES[mode]}"
                row = run_row(name, common + WORKLOADS[wl] + extra + [f"runtime.vectorize={str(vec).lower()}",
                                                                     f"runtime.cuda_graphs={str(cuda_graphs).lower()}"])
                row.update({"workload": wl, "clients_per_round": k, "where": where, "vectorize": vec, "graphs": graphs})
                rows.append(row)
                shown = ("row", "round_s", "rounds_s", "server_s", "busy_pct", "groups_per_step", "graph_steps", "accuracy",
                         "error")
                print(json.dumps({key: row.get(key) for key in shown}), flush=True)
                write(record, Path(args.out), done=False)
    if args.profile and not profiled:
        profile_rows(record, args)
    write(record, Path(args.out), done=True)
    print((Path(args.out) / "gpu.md").read_text())


def write(record: dict, out: Path, done: bool) -> None:
    """``gpu.json`` and ``gpu.md`` from the rows so far; ``done`` false marks both as partial."""
    rows = record["rows"]
    for row in rows:
        # a bf16 workload is compared with float32's sequential round when there is one: the faster of the two,
        # what a user would run without vectorising (bf16's own made its speed-up look better than it is)
        seq = next((r for w in dict.fromkeys((row["workload"].removesuffix("_bf16"), row["workload"])) for r in rows
                    if r["workload"] == w and r["clients_per_round"] == row["clients_per_round"]
                    and r["where"] == row["where"] and not r["vectorize"]), None)
        row.setdefault("graphs", False)  # rows of runs before runtime.cuda_graphs
        if row["vectorize"] and seq and seq["round_s"] and row["round_s"]:
            row["speedup_vs_sequential"] = seq["round_s"] / row["round_s"]
    record["complete"] = done
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(record, indent=2) + "\n")
    title = f"GPU throughput ({record['device']}, torch {record['torch']}, {record['date']})"
    lines = [f"# {title}" + ("" if done else " - partial: the run did not finish"), "",
             "| workload | clients/round | where | clients | s/round | of it server | busy % | speed-up | vmap calls/step "
             "| graph steps | accuracy |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        busy = "-" if r["busy_pct"] is None else f"{r['busy_pct']:.0f}"
        up = f"{r['speedup_vs_sequential']:.2f}x" if "speedup_vs_sequential" in r else ""
        clients = MODES["graphs" if r["graphs"] else "vectorised" if r["vectorize"] else "sequential"]
        calls = "" if r.get("groups_per_step") is None else f"{r['groups_per_step']:.2f}"
        replayed = "" if r.get("graph_steps") is None else f"{100 * r['graph_steps']:.0f} %"
        server = "" if r.get("server_s") is None else f"{r['server_s']:.3f}"
        if r.get("error"):
            lines.append(f"| {r['workload']} | {r['clients_per_round']} | {r['where']} | {clients} | failed: "
                         f"{r['error'][:120].replace('|', '/')} | | | | | | |")
            continue
        lines.append(f"| {r['workload']} | {r['clients_per_round']} | {r['where']} | {clients} | {r['round_s']:.3f} "
                     f"| {server} | {busy} | {up} | {calls} | {replayed} | {r['accuracy']:.4f} |")
    if any(r["workload"].endswith("_bf16") and "speedup_vs_sequential" in r for r in rows):
        lines += ["", "speed-up: over the same workload's sequential round; a `_bf16` workload's, over float32's "
                  "sequential round when the table has it."]
    if record.get("graph_check"):
        lines += ["", "CUDA graphs against eager steps (`--graph-check`: one round of 8 clients, 20 steps, the same seed):",
                  "", "| run | cuDNN deterministic | steps replayed | max abs difference, graphs vs eager "
                  "| identical | max abs difference, eager vs eager |",
                  "| --- | --- | ---: | ---: | --- | ---: |"]
        for c in record["graph_check"]:
            if c.get("error"):
                lines.append(f"| {c['run']} | {c['cudnn_deterministic']} | failed: {c['error'][:120].replace('|', '/')} "
                             "| | | |")
                continue
            lines.append(f"| {c['run']} | {c['cudnn_deterministic']} | {100 * c['graph_steps']:.0f} % "
                         f"| {c['max_abs_diff']:.3g} | {c['identical']} | {c['eager_repeat_diff']:.3g} |")
    if not record["ray_rows"]:
        lines += ["", "Ray rows skipped (Ray not installed here, `--no-ray`, or a CPU run)."]
    if record.get("profiled"):
        lines += ["", "Round 2 under `torch.profiler` (one more 3-round run per row; the profiler slows the host):", "",
                  "| workload | clients/round | clients | round s (profiled) | aten ops | GPU kernels and copies | host waits "
                  "| cudaMemcpyAsync | kernel time / round |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for p in record["profiled"]:
            clients = MODES["graphs" if p.get("graphs") else "vectorised" if p["vectorize"] else "sequential"]
            if p.get("error"):
                lines.append(f"| {p['workload']} | {p['clients_per_round']} | {clients} | failed: "
                             f"{p['error'][:120].replace('|', '/')} | | | | | |")
                continue
            share = "-" if p["kernel_time_share"] is None else f"{100 * p['kernel_time_share']:.0f} %"
            lines.append(f"| {p['workload']} | {p['clients_per_round']} | {clients} | {p['round_wall_s']:.3f} "
                         f"| {p['aten_ops']} | {p['kernels']} | {p['waits']} | {p['memcpy_async']} | {share} |")
    (out / "gpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
