"""How far a method's local training carries a float-rounding-sized difference: the round-1 clients' uploads,
one client at a time (the reference), against (a) the same clients vectorised (``runtime.vectorize=true``: the
same computation in another float32 rounding) and (b) the reference started from the broadcast weights multiplied
by (1 + 1e-6 * N(0, 1)) (a perturbation of the size of float32 rounding, seeded). Per client, the largest
relative difference over the upload's floating tensors (max |a - b| / max |a|, tensor by tensor), for a few
local-step budgets.

If (a) is of the size of (b), the lockstep does what the reference does and the method itself amplifies the
rounding; if (a) were far above (b), the lockstep would compute something else. On real Fashion-MNIST, 20 clients,
alpha = 0.1, the presets ``quickstart`` (FedAvg) and ``dafkd_fmnist`` (DaFKD's GAN steps), on a CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/sensitivity.py [--presets quickstart dafkd_fmnist] [--steps 5 20]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/sensitivity.py --presets quickstart --name sensitivity_fedavg_adam \
        --set federation.optimizer=adam federation.lr=0.001 federation.weight_decay=0.001   # FedAvg with DaFKD's Adam
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedray.load import load_config
from fedray.data import build_federated_data
from fedray.data.federated import FederatedData
from fedray.runtime import make_runtime
from fedray.seeding import sample_clients


def named_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The floating tensors inside an upload (dataclasses, dicts, lists), by path."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        return {prefix: obj} if isinstance(obj, torch.Tensor) and obj.is_floating_point() else {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(named_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def perturbed(obj: Any, rel: float, gen: torch.Generator) -> Any:
    """A deep copy of ``obj`` with every floating tensor multiplied by (1 + rel * N(0, 1))."""
    out = copy.deepcopy(obj)
    for t in named_tensors(out).values():
        t.mul_(1 + rel * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype))
    return out


def max_rel(a: Any, b: Any, prefix: str = "") -> tuple[float, str]:
    """The largest relative difference between two uploads' tensors (those whose path starts with ``prefix``),
    and that tensor's path."""
    ta, tb = named_tensors(a), named_tensors(b)
    return max((float((ta[k].double() - tb[k].double()).abs().max() / (ta[k].double().abs().max() + 1e-30)), k)
               for k in ta if k.startswith(prefix))


def round1_uploads(preset: str, steps: int, vectorize: bool, overrides: list[str], data: FederatedData,
                   rel: float = 0.0) -> tuple[list[int], list[Any]]:
    cfg = load_config(preset, [*overrides, f"federation.local_steps={steps}", f"runtime.vectorize={str(vectorize).lower()}",
                               "runtime.vectorize_min_clients=1", "runtime.num_cpus_per_worker=1",
                               "tracking.enabled=false"])
    cids = sample_clients(cfg.seed, 1, data.num_clients, cfg.federation.clients_per_round)
    with make_runtime(cfg, data) as rt:
        payload, _ = rt.server.payload(0)
        if rel:
            payload = perturbed(payload, rel, torch.Generator().manual_seed(0))
        return cids, [u for u, _, _, _ in rt.worker.train_many(1, cids, payload, [None] * len(cids))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["quickstart", "dafkd_fmnist"])
    ap.add_argument("--steps", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every preset")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="sensitivity", help="the record's file names: NAME.json, NAME.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for preset in args.presets:
        cfg = load_config(preset, args.set)
        data = build_federated_data(cfg.data, cfg.seed)  # the local-step budget and vectorising leave the data alone
        for steps in args.steps:
            cids, ref = round1_uploads(preset, steps, False, args.set, data)
            _, vec = round1_uploads(preset, steps, True, args.set, data)
            _, pert = round1_uploads(preset, steps, False, args.set, data, rel=1e-6)
            a, b = [max_rel(r, v) for r, v in zip(ref, vec)], [max_rel(r, p) for r, p in zip(ref, pert)]
            # the classifier alone (upload.weights: what is averaged and evaluated)
            ca = [max_rel(r, v, "weights.")[0] for r, v in zip(ref, vec)]
            cb = [max_rel(r, p, "weights.")[0] for r, p in zip(ref, pert)]
            row = {"preset": preset, "local_steps": steps, "clients": cids,
                   "vectorised": [x for x, _ in a], "perturbed": [x for x, _ in b],
                   "vectorised_classifier": ca, "perturbed_classifier": cb,
                   "vectorised_worst_tensor": max(a)[1], "perturbed_worst_tensor": max(b)[1]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"# Round-1 uploads: sequential vs vectorised, and vs a 1e-6 perturbation ({platform.processor() or 'cpu'}, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Overrides: {' '.join(args.set) or 'none'}.", "",
             "Largest relative difference over an upload's tensors, per client: median and max over the round's clients.", "",
             "| preset | local steps | vectorised: median | max | perturbed 1e-6: median | max | worst tensor (vectorised / perturbed) "
             "| classifier only, vectorised: max | perturbed: max |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['local_steps']} | {np.median(r['vectorised']):.1e} | {max(r['vectorised']):.1e} | "
                     f"{np.median(r['perturbed']):.1e} | {max(r['perturbed']):.1e} | "
                     f"{r['vectorised_worst_tensor']} / {r['perturbed_worst_tensor']} | "
                     f"{max(r['vectorised_classifier']):.1e} | {max(r['perturbed_classifier']):.1e} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"overrides": args.set, "rows": rows}, indent=1))
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
