"""The ceiling of a vectorised local step on a GPU: how fast K clients' SGD step can go, with and without CUDA graphs.

``benchmarks/speed/gpu.py`` measures fedray's rounds; this measures the step alone, outside fedray's runtime, to say
what replaying the lockstep step as a CUDA graph would buy before anyone builds it. Per model (LeNet-5,
ResNet-8; 1x28x28 uint8 images normalised on the device, batch 32, cross-entropy, plain SGD) and K clients:

- ``sequential``: one client's eager step (forward, ``backward``, a foreach SGD step) timed, times K: what the
  sequential runtime's steps cost at best.
- ``vmap eager``: the K clients' step as ``runtime.vectorize`` takes it: parameters stacked on a client axis,
  ``vmap(functional_call)``, one ``backward`` of the summed losses, one foreach SGD step.
- ``vmap graph/step``: the same step as ``vmap(grad(loss))`` plus the foreach update captured once in a CUDA
  graph and replayed each step (the step's batch index copied into the graph's input first).
- ``vmap graph/round``: all ``--steps`` steps of a round captured as one graph (every step's index on the
  device up front), replayed once a round.
- ``sequential graph/step``: the K clients' steps one after another, no ``vmap`` (each client ``grad`` of its
  own slice of the stacked parameters, plain convolutions), captured as one graph and replayed each step: whether
  vmap's batched kernels (a convolution over K weight sets is a grouped one) or the launches are what costs.

Times are wall time per step with the GPU synchronised before and after ``--reps`` steps (a graph's replay is
the GPU's own time, give or take a launch). The graph rows need CUDA; on a CPU run they are skipped.

``--variants``: the same rows under other kernel settings, to find what lifts the ceiling where the batched
convolutions (not the launches) set it (ResNet-11, or any model at 32 clients):

- ``default``: torch's defaults (cuDNN's heuristic algorithm choice, float32 with cuDNN's TF32 convolutions);
- ``cudnn_benchmark``: ``torch.backends.cudnn.benchmark`` (cuDNN times its algorithms for each shape, a
  grouped convolution's included, and keeps the fastest);
- ``bf16``: the whole step in bfloat16 (weights, BatchNorm buffers, images, gradients and the update; the loss
  in float32): what bf16 convolutions would give, a probe of the ceiling rather than a training recipe. (Its
  first form, the forward under ``torch.autocast``, failed on CUDA: BatchNorm's float32 running statistics
  against a bf16 input, "Expected running_mean to have type BFloat16", H100 2026-11-28.)

(``torch.channels_last`` is not among them: ``vmap`` refuses it, "NYI: querying is_contiguous inside of vmap".)

    python benchmarks/speed/step_ceiling.py --out results/gpu [--clients 8 32] [--models lenet5 resnet8]
    python benchmarks/speed/step_ceiling.py --out results/gpu --models resnet11 --variants default cudnn_benchmark bf16
    .venv/bin/python benchmarks/speed/step_ceiling.py --device cpu --clients 4 --reps 5 --out /tmp/g  # dry run

Writes ``OUT/step_ceiling.json`` and ``OUT/step_ceiling.md`` after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedray.models import build_model

BATCH, LR, ROWS_PER_CLIENT = 32, 0.01, 256


def timed(step: Callable[[int], None], reps: int, device: torch.device, per_call: int = 1) -> float:
    """Milliseconds per step of ``step(i)`` (each call taking ``per_call`` steps), after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(2):
        step(i)
    sync()
    calls = max(1, reps // per_call)
    t0 = time.perf_counter()
    for i in range(calls):
        step(i)
    sync()
    return 1000 * (time.perf_counter() - t0) / (calls * per_call)


VARIANTS = ("default", "cudnn_benchmark", "bf16")


@contextlib.contextmanager
def settings(variant: str) -> Iterator[None]:
    """The process-wide flags of ``variant`` while its rows run (the default ones restored after)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = variant == "cudnn_benchmark"
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def measure(model_name: str, k: int, steps: int, reps: int, device: torch.device, variant: str = "default") -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    model = build_model(model_name, (1, 28, 28), 10).to(device, dtype)
    data_x = torch.randint(0, 256, (k * ROWS_PER_CLIENT, 1, 28, 28), dtype=torch.uint8, device=device)
    data_y = torch.randint(0, 10, (k * ROWS_PER_CLIENT,), device=device)
    # per step and client, BATCH rows of that client's own share of the data
    own = torch.arange(k, device=device)[:, None] * ROWS_PER_CLIENT
    index = torch.randint(0, ROWS_PER_CLIENT, (steps, k, BATCH), device=device) + own

    def batch(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (data_x[idx].to(dtype) / 255 - 0.5) / 0.5, data_y[idx]

    row: dict = {"model": model_name, "clients": k, "variant": variant}

    params = [p for p in model.parameters()]

    def sequential(i: int) -> None:
        x, y = batch(index[i % steps, 0])
        F.cross_entropy(model(x).float(), y).backward()  # the loss in float32
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)
        for p in params:
            p.grad = None

    row["sequential_ms"] = k * timed(sequential, reps, device)

    stacked = {n: p.detach().expand(k, *p.shape).clone() for n, p in model.named_parameters()}
    buffers = {n: b.expand(k, *b.shape).clone() for n, b in model.named_buffers()}
    leaves = {n: p.clone().requires_grad_(True) for n, p in stacked.items()}

    def one_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, (p, b), (x,)).float(), y)

    eager_call = vmap(one_loss, randomness="different")

    def vmap_eager(i: int) -> None:
        x, y = batch(index[i % steps])
        eager_call(leaves, buffers, x, y).sum().backward()
        with torch.no_grad():
            torch._foreach_add_(list(leaves.values()), [p.grad for p in leaves.values()], alpha=-LR)
        for p in leaves.values():
            p.grad = None

    row["vmap_eager_ms"] = timed(vmap_eager, reps, device)

    if device.type != "cuda":
        row["graph"] = "skipped: needs CUDA"
        return row
    grads_of = vmap(grad(one_loss), randomness="different")
    weights = list(stacked.values())

    def functional_step(idx: torch.Tensor) -> None:
        x, y = batch(idx)
        g = grads_of(stacked, buffers, x, y)
        torch._foreach_add_(weights, [g[n] for n in stacked], alpha=-LR)

    static_index = index[0].clone()

    def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph

    try:
        per_step = capture(lambda: functional_step(static_index))

        def graph_step(i: int) -> None:
            static_index.copy_(index[i % steps])
            per_step.replay()

        row["graph_step_ms"] = timed(graph_step, reps, device)
        whole = capture(lambda: [functional_step(index[s]) for s in range(steps)])
        row["graph_round_ms"] = timed(lambda i: whole.replay(), reps, device, per_call=steps)
        grad_one = grad(one_loss)
        own_p = [{n: t[i] for n, t in stacked.items()} for i in range(k)]  # views: the steps move the stack
        own_b = [{n: t[i] for n, t in buffers.items()} for i in range(k)]

        def clients_step(idx: torch.Tensor) -> None:
            for i in range(k):
                x, y = batch(idx[i])
                g = grad_one(own_p[i], own_b[i], x, y)
                torch._foreach_add_(list(own_p[i].values()), [g[n] for n in own_p[i]], alpha=-LR)

        one_by_one = capture(lambda: clients_step(static_index))

        def seq_graph_step(i: int) -> None:
            static_index.copy_(index[i % steps])
            one_by_one.replay()

        row["seq_graph_step_ms"] = timed(seq_graph_step, reps, device)
    except Exception as exc:  # the eager figures still count; say why the graph ones are missing
        row["graph"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return row


def write(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_ceiling.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# One local step of K clients ({record['device']}, torch {record['torch']}, {record['date']})", "",
             "ms per step of all K clients (batch 32 each, plain SGD); speed-ups against `sequential` under "
             "the default settings (the first variant row of the model and K).", "",
             "| model | K | variant | sequential | vmap eager | vmap graph/step | vmap graph/round "
             "| sequential graph/step | best speed-up |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    baseline: dict[tuple, float] = {}
    for r in record["rows"]:
        head = f"| {r['model']} | {r['clients']} | {r.get('variant', 'default')} |"
        if r.get("error"):
            lines.append(f"{head} failed: {r['error'][:150].replace('|', '/')} | | | | | |")
            continue
        cells = [r.get(key) for key in ("sequential_ms", "vmap_eager_ms", "graph_step_ms", "graph_round_ms",
                                        "seq_graph_step_ms")]
        shown = [f"{c:.3f}" if c is not None else r.get("graph", "-")[:60] for c in cells]
        base = baseline.setdefault((r["model"], r["clients"]), cells[0])
        best = min(c for c in cells[1:] if c is not None)
        lines.append(f"{head} " + " | ".join(shown) + f" | {base / best:.1f}x |")
    (out / "step_ceiling.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--models", nargs="+", default=["lenet5", "resnet8", "resnet11"])
    ap.add_argument("--steps", type=int, default=20, help="steps of a round (the graph/round row)")
    ap.add_argument("--reps", type=int, default=60, help="steps timed per figure")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=VARIANTS,
                    help="kernel settings to time each row under (the first is the speed-ups' baseline)")
    args = ap.parse_args()
    device = torch.device(args.device if args.device == "cpu" or torch.cuda.is_available() else "cpu")
    record = {"benchmark": "step_ceiling", "date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "rows": []}
    for model_name in args.models:
        for k in args.clients:
            for variant in args.variants:
                try:
                    with settings(variant):
                        row = measure(model_name, k, args.steps, args.reps, device, variant)
                except Exception as exc:  # one broken row must not cost the others (device time is scarce)
                    row = {"model": model_name, "clients": k, "variant": variant,
                           "error": f"{type(exc).__name__}: {exc}"[:300]}
                record["rows"].append(row)
                print(json.dumps(row), flush=True)
                write(record, Path(args.out))
    print((Path(args.out) / "step_ceiling.md").read_text())


if __name__ == "__main__":
    main()
