"""Server-side teacher ensemble: the loop over client models vs one stacked forward (issue 13, item 2).

K teachers of ``--model`` (LeNet-5 by default; random weights; 1x28x28, 10 classes) on N uint8 images
normalised per batch, as FedDF/FedD3A's ``teacher_logits`` runs them:

  loop     load_state_dict + forward per teacher, batches of ``--batch`` (federation.eval_batch_size)
  stacked  fedray.learning.ensemble.stacked_outputs as configured for the device (on a CPU vmap over the
           stacked state dicts, teachers x images per forward <= batch, the loop's memory; on CUDA teacher
           by teacher, functional calls on whole batches)
  stacked_budget  vmapped on any device, chunks grown to the activation budget (ACTIVATION_BUDGET_BYTES)
  budget_<MiB>    with ``--budgets-mib``: the same with that activation budget

Median of ``--repeats`` timings after one warm-up (the variants taking turns), for each thread count;
the max |difference| of the outputs is printed too. Prints one JSON line per row and the host's load (``os.getloadavg``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/server_ensemble.py [--teachers 8 20] [--images 1000]
    python3 benchmarks/speed/server_ensemble.py --device cuda --model resnet11 --teachers 8 32 --threads 1 \
        --budgets-mib 4096  # on a GPU: teacher by teacher against vmapped, and a larger chunk budget
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from fedray.learning import ensemble
from fedray.learning.ensemble import loop_outputs, stacked_outputs
from fedray.learning.weights import clone_weights
from fedray.models import build_model


def _time_interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median seconds per variant; the variants take turns in every repeat, so that the load of a shared
    machine falls on all of them alike."""
    outs = {name: fn() for name, fn in fns.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--teachers", type=int, nargs="+", default=[8, 20])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--budgets-mib", type=int, nargs="*", default=[], help="fixed activation budgets to compare")
    a = ap.parse_args()
    dev = torch.device(a.device)
    shape = (1, 28, 28)
    x = torch.randint(0, 256, (a.images, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).to(dev)
    prep = lambda t: (t.float() / 255 - 0.2860) / 0.3530  # noqa: E731  (Fashion-MNIST's mean / std)
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
                      "torch": torch.__version__, "loadavg": os.getloadavg()}))
    saved = ensemble.BUDGET_DEVICES, ensemble.LOOP_DEVICES, ensemble.ACTIVATION_BUDGET_BYTES
    for threads in a.threads:
        torch.set_num_threads(threads)
        for k in a.teachers:
            module = build_model(a.model, shape, 10).to(dev)
            teachers = []
            for i in range(k):
                torch.manual_seed(i)
                teachers.append((module, clone_weights(build_model(a.model, shape, 10))))
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

            def run(f):
                def go():
                    out = f(teachers, x, a.batch, prep)[0]
                    sync()
                    return out
                return go

            def budget(f, mib=None):
                def go():
                    ensemble.BUDGET_DEVICES, ensemble.LOOP_DEVICES = (dev.type,), ()
                    if mib is not None:
                        ensemble.ACTIVATION_BUDGET_BYTES = mib * 2**20
                    try:
                        return f()
                    finally:
                        ensemble.BUDGET_DEVICES, ensemble.LOOP_DEVICES, ensemble.ACTIVATION_BUDGET_BYTES = saved
                return go

            variants = {"loop": run(loop_outputs), "stacked": run(stacked_outputs),
                        "budget": budget(run(stacked_outputs))}
            variants.update({f"budget_{mib}": budget(run(stacked_outputs), mib) for mib in a.budgets_mib})
            t, outs = _time_interleaved(variants, a.repeats)
            ref = outs["loop"]
            diff = max(float((out - ref).abs().max()) for out in outs.values())
            print(json.dumps({"model": a.model, "threads": threads, "teachers": k, "images": a.images,
                              "loop_s": round(t["loop"], 4), "stacked_s": round(t["stacked"], 4),
                              "stacked_budget_s": round(t["budget"], 4),
                              **{f"budget_{mib}_mib_s": round(t[f"budget_{mib}"], 4) for mib in a.budgets_mib},
                              "speedup": round(t["loop"] / t["stacked"], 2), "max_abs_diff": diff,
                              "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
