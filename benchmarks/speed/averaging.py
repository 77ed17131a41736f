"""The server's weighted average (FedAvg's step, DaFKD's Eq. 4 and 6): ``weighted_average`` against the plain
float64 sum it replaced, ``acc += w.to(float64) * (c / total)``, which made two float64 temporaries per client
and key. K uploads of ``--models`` (random weights; DaFKD's DCGAN generator as ``dcgan``), sample counts as
coefficients, one CPU thread by default, glibc's malloc tuned as in a run's server process
(``runtime.malloc_tuning``, default true; ``--no-malloc-tuning``: glibc's defaults). Median of ``--repeats`` after one warm-up, the two taking turns; the
outputs are checked bit-identical. Prints a Markdown table and writes it with the JSON rows to ``--out``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/averaging.py --out benchmarks/results/averaging
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/averaging.py --no-malloc-tuning --out benchmarks/results/averaging_glibc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedray.learning.weights import Weights, weighted_average
from fedray.models import build_model
from fedray.models.dcgan import DCGANGenerator
from fedray.runtime.malloc import keep_freed_memory

from overhead import _cpu_name  # benchmarks/speed/ is the script's folder, first on sys.path


def plain_sum(weights: list[Weights], coefs: list[float]) -> Weights:
    """The implementation before 2026-11-28, kept as the reference."""
    total = float(sum(coefs))
    out: Weights = {}
    for key, ref in weights[0].items():
        if not torch.is_floating_point(ref):
            out[key] = ref.clone()
            continue
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for w, c in zip(weights, coefs):
            acc += w[key].to(torch.float64) * (c / total)
        out[key] = acc.to(ref.dtype)
    return out


def uploads(model: str, k: int) -> list[Weights]:
    net = (DCGANGenerator(100, (1, 28, 28), 64, (0.5,), (0.5,)) if model == "dcgan"
           else build_model(model, (1, 28, 28), 10))
    g = torch.Generator().manual_seed(0)
    return [{n: (t + torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone())
             for n, t in net.state_dict().items()} for _ in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["lenet5", "resnet11", "dcgan"])
    ap.add_argument("--clients", nargs="+", type=int, default=[8, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-malloc-tuning", action="store_true")
    args = ap.parse_args()
    tuned = keep_freed_memory(not args.no_malloc_tuning)
    rows = []
    for model in args.models:
        for k in args.clients:
            ws = uploads(model, k)
            coefs = [float(100 + 37 * i % 400) for i in range(k)]
            assert all(torch.equal(a, b) for a, b in zip(weighted_average(ws, coefs).values(),
                                                          plain_sum(ws, coefs).values()))
            times: dict[str, list[float]] = {"plain": [], "buffer": []}
            for _ in range(args.repeats):
                for name, fn in (("plain", plain_sum), ("buffer", weighted_average)):
                    t = time.perf_counter()
                    fn(ws, coefs)
                    times[name].append(time.perf_counter() - t)
            row = {"model": model, "clients": k, "params": sum(t.numel() for t in ws[0].values()),
                   **{name: statistics.median(v) for name, v in times.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"# Weighted average, {_cpu_name()}, {torch.get_num_threads()} thread(s), "
             f"torch {torch.__version__}, malloc {'tuned' if tuned else 'glibc defaults'}", "", "| model | values | clients | plain float64 sum (s) | reused buffer (s) "
             "| speed-up |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['params']:,} | {r['clients']} | {r['plain']:.4f} | {r['buffer']:.4f} | "
              f"{r['plain'] / r['buffer']:.2f}x |" for r in rows]
    lines += ["", "Outputs bit-identical in every row."]
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
