"""FedD3A's Table 2 ("Classification ability of subspace projection") on real Fashion-MNIST, plus the same
question for domains.

The experiment (FedD3A Sec. 4, "Classification Ability of Subspace Projection"): split a dataset so that
each client holds one class; every client extracts the features of its data with the shared backbone and
uploads either its projection matrix (Eq. 5, :func:`fedray.learning.subspace.projector`) or its mean
feature (the prototype); the server assigns each test image to the client whose projection gives the
highest cos(u, P_k u) (projection-based), or whose prototype has the highest cosine similarity with u
(prototype-based). Accuracy is the share of test images assigned to their own class; 3 seeds. The paper:
MNIST with a 3-layer MLP, prototype 0.693 +- 0.005 vs projection 0.907 +- 0.004 (CIFAR-10 / ResNet-18
0.494 vs 0.628, ...).

Settings here:

- ``classes``: Fashion-MNIST (60,000 train / 10,000 test), 10 clients, client k = all 6,000 training images
  of class k; a test image is right when assigned to the client of its class (chance 0.1).
- ``domains``: ``fmnist_domains`` (Fashion-MNIST dealt into 5 disjoint shares, transformed as original /
  rotated / inverted / noisy / blurred; see fedray/data/domains.py), ``data.partition=domain``: 5 clients,
  client k = all 12,000 training images of domain k (its train and local-test split together); a global
  test image (2,000 per domain) is right when assigned to the client of its domain (chance 0.2). This is
  the use FedD3A makes of the projection: telling which client domain a server sample resembles.

Backbones (the paper says only "with only one round"; its MNIST model is "a 3-layer MLP"):

- ``random``: the global model's initialisation, untrained. This is literally what a client holds when it
  computes P in FedD3A's first round (Algorithm 1 computes P_k before local training).
- ``fedavg1``: the global model after one FedAvg round of the same clients: each client trains its copy of
  the initialisation for one epoch on its own data (class labels, SGD lr 0.05, batch 64, momentum 0), the
  server averages the copies weighted by data size. In ``classes`` every client has a single class, so
  this round is the degenerate one-class-per-client FedAvg round.
- ``pooled``: one epoch of centralised training on the pooled client data (class labels, same optimiser):
  a backbone with useful features, not something a federation has after one round; a reference.

Models: ``mlp`` = fedray's "2NN" (flatten -> FC 200 ReLU -> FC 200 ReLU -> head; three linear layers, the
200-d output of the second hidden layer is the feature), and ``lenet5`` (84-d features), optional.

The projection: Eq. 5's batch means over the client's features in a random order (a shuffled data loader
with ``--batch-size`` = 256, the paper's batch size; last batch partial), computed in closed form (equal
to the recursion, tests/learning/test_subspace.py). Also ``b=1``: every feature a row of Z, the paper's
``P = Z^T (Z Z^T + a I)^-1 Z`` before it introduces batch means. The ridge ``a`` is not given by the paper;
its "P = I - P_hat" holds for a = 1, which is the headline column, fixed before looking at results; the
sweep covers 1e-6 ... 1e6. Two ways to pick (a, b) are reported: ``validated`` (each client holds out 10%
of its data, the projections are fitted on the other 90%, the (a, b) that classifies the held-out features
best is then scored on the test set; no test labels used, though trained backbones have seen the held-out
images) and ``best`` (picked on the test set itself: optimistic). ``a`` is not scale-free: it competes with
the eigenvalues of Zb^T Zb, which grow with the feature norm (recorded per run as ``mean_sq_norm``) and,
for b = 1, with the number of samples.
Features are the raw backbone outputs (no centring or normalisation), as in the paper.

Seeds (0, 1, 2) change the initialisation, the batch order of the batch means and the training order;
the data split is fixed. mean +- std is over seeds (sample std, ddof=1).

Not a grid of fedray runs (no federation: one forward pass per backbone), so not through harness.py: its
record, benchmarks/results/subspace_fmnist.json, holds every run (one per setting x model x backbone x
seed) and is what ``--report-only`` rebuilds subspace_fmnist.md from, with fedray.report's mean ± std.
About 6 minutes on one core.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/papers/subspace_fmnist.py                 # the recorded run
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/papers/subspace_fmnist.py --seeds 0 --models mlp --no-write  # smoke
    .venv/bin/python benchmarks/papers/subspace_fmnist.py --report-only   # subspace_fmnist.md from the record
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedray.learning.subspace import projection_cosine, projector  # noqa: E402
from fedray.load import load_config  # noqa: E402
from fedray.data import build_federated_data, to_float  # noqa: E402
from fedray.models import build_model  # noqa: E402
from fedray.report.runs import fmt_mean_std  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SETTINGS = ("classes", "domains")
BACKBONES = ("random", "fedavg1", "pooled")
MODELS = ("mlp", "lenet5")
RIDGES = (1e-6, 1e-4, 1e-2, 1.0, 1e1, 1e2, 1e3, 1e4, 1e6)
HEADLINE_A = 1.0
LR, TRAIN_BATCH, EVAL_BATCH = 0.05, 64, 2048
VAL_SHARE = 0.1  # of each client's data, held out to choose (a, b) without the test set

# FedD3A Table 2 (other datasets and models; NOT Fashion-MNIST): (prototype, projection) mean, std.
PAPER = {
    "MNIST, 3-layer MLP (10 clients)": ((0.693, 0.005), (0.907, 0.004)),
    "DomainNet, ResNet-50 (345 clients)": ((0.382, 0.007), (0.434, 0.009)),
    "CIFAR-10, ResNet-18 (10 clients)": ((0.494, 0.063), (0.628, 0.005)),
    "CIFAR-100, ResNet-18 (100 clients)": ((0.358, 0.007), (0.444, 0.003)),
    "Tiny ImageNet, ResNet-50 (200 clients)": ((0.411, 0.024), (0.504, 0.036)),
}


# ---------------------------------------------------------------- data


def load_setting(setting: str, data_dir: str | None) -> dict:
    """uint8 train images, one index array per client, test images and each test image's client."""
    over = {"data.dataset": "fashion_mnist" if setting == "classes" else "fmnist_domains",
            "data.partition": "iid" if setting == "classes" else "domain", "data.num_clients": 1,
            "federation.clients_per_round": 1}
    if data_dir:
        over["data.data_dir"] = data_dir
    cfg = load_config(None, over)
    fd = build_federated_data(cfg.data, 0)  # seed-independent here: every client takes its whole share
    if setting == "classes":
        # One client per class: the whole training split, by label (the iid single client is all of it).
        clients = [np.flatnonzero(fd.train_y == c) for c in range(fd.num_classes)]
        test_owner = fd.test_y.copy()
        names = [str(c) for c in range(fd.num_classes)]
    else:
        clients = [np.sort(np.concatenate([tr, te])) for tr, te in zip(fd.client_train, fd.client_test)]
        dom_to_client = {int(d): k for k, d in enumerate(fd.client_domain)}
        test_owner = np.array([dom_to_client[int(d)] for d in fd.test_domain], dtype=np.int64)
        names = [fd.client_domain_name(k) for k in range(fd.num_clients)]
    return {"x": torch.from_numpy(fd.train_x), "y": torch.from_numpy(fd.train_y), "clients": clients,
            "test_x": torch.from_numpy(fd.test_x), "test_owner": torch.from_numpy(test_owner),
            "mean": fd.mean, "std": fd.std, "num_classes": fd.num_classes, "names": names,
            "input_shape": fd.input_shape}


# ---------------------------------------------------------------- backbones


def train_epoch(model, data: dict, idx: np.ndarray, gen: torch.Generator) -> None:
    """One epoch of SGD (lr LR, batch TRAIN_BATCH) with cross-entropy on the class labels of ``idx``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    order = torch.from_numpy(idx)[torch.randperm(len(idx), generator=gen)]
    for start in range(0, len(order), TRAIN_BATCH):
        b = order[start : start + TRAIN_BATCH]
        loss = F.cross_entropy(model(to_float(data["x"][b], data["mean"], data["std"])), data["y"][b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def make_backbone(name: str, kind: str, data: dict, seed: int):
    torch.manual_seed(seed)
    model = build_model(name, data["input_shape"], data["num_classes"])
    gen = torch.Generator().manual_seed(seed)
    if kind == "pooled":
        train_epoch(model, data, np.concatenate(data["clients"]), gen)
    elif kind == "fedavg1":
        init = {k: v.clone() for k, v in model.state_dict().items()}
        sizes = np.array([len(c) for c in data["clients"]], dtype=np.float64)
        avg = {k: torch.zeros_like(v) for k, v in init.items()}
        for idx, w in zip(data["clients"], sizes / sizes.sum()):
            model.load_state_dict(init)
            train_epoch(model, data, idx, gen)
            for k, v in model.state_dict().items():
                avg[k] += w * v
        model.load_state_dict(avg)
    elif kind != "random":
        raise ValueError(kind)
    return model.eval()


@torch.no_grad()
def features(model, x: torch.Tensor, data: dict) -> torch.Tensor:
    return torch.cat([model.features(to_float(x[s : s + EVAL_BATCH], data["mean"], data["std"]))
                      for s in range(0, len(x), EVAL_BATCH)]).to(torch.float64)


# ---------------------------------------------------------------- the two classifiers


def _recall(pred: torch.Tensor, owner: torch.Tensor, k: int) -> list[float]:
    """Per client: the share of its test images (its class / domain) assigned to it."""
    return [round(float((pred[owner == c] == c).double().mean()), 4) for c in range(k)]


def evaluate(model, data: dict, seed: int, ridges, batch_sizes) -> dict:
    """Test accuracies of one backbone: ``prototype``, ``projection`` {b: {a: acc}} and ``validated`` (the
    (a, b) a held-out share of the clients' own data picks, and its test accuracy), plus per-client recall
    (prototype; projection at the headline a and the main b) and feature statistics."""
    train_f = features(model, data["x"], data)
    test_f = features(model, data["test_x"], data)
    owner = data["test_owner"]
    gen = torch.Generator().manual_seed(10_000 + seed)
    k = len(data["clients"])
    protos = torch.stack([train_f[idx].mean(dim=0) for idx in data["clients"]])
    proto_pred = F.cosine_similarity(test_f[:, None, :], protos[None], dim=2).argmax(1)
    out = {"prototype": float((proto_pred == owner).double().mean()), "projection": {},
           "feature_dim": int(train_f.shape[1]),
           "dead_features": int((train_f.abs().amax(0) == 0).sum()),
           "mean_sq_norm": float(train_f.square().sum(1).mean()),
           "recall": {"prototype": _recall(proto_pred, owner, k)}}
    # Each client's features in a shuffled order, as a data loader would give its batches.
    shuffled = [train_f[torch.from_numpy(idx)[torch.randperm(len(idx), generator=gen)]] for idx in data["clients"]]
    for b in batch_sizes:
        row = {}
        for a in ridges:
            P = torch.stack([projector(z, a, batch_size=b) for z in shuffled])
            r = projection_cosine(P, test_f)
            row[repr(a)] = float((r.argmax(1) == owner).double().mean())
            if a == HEADLINE_A and b == batch_sizes[0]:
                out["recall"]["projection"] = _recall(r.argmax(1), owner, k)
        out["projection"][str(b)] = row
    # (a, b) chosen without the test set: each client keeps the first VAL_SHARE of its shuffled features
    # apart, the projections are fitted on the rest, the server picks the (a, b) that classifies the
    # pooled held-out features best, and that choice's projections are scored on the test set.
    n_val = [max(1, int(round(VAL_SHARE * len(z)))) for z in shuffled]
    val_f = torch.cat([z[:v] for z, v in zip(shuffled, n_val)])
    val_owner = torch.repeat_interleave(torch.arange(k), torch.tensor(n_val))
    best = None
    for b in batch_sizes:
        for a in ridges:
            P = torch.stack([projector(z[v:], a, batch_size=b) for z, v in zip(shuffled, n_val)])
            acc = float((projection_cosine(P, val_f).argmax(1) == val_owner).double().mean())
            if best is None or acc > best[0]:
                best = (acc, a, b, P)
    acc, a, b, P = best
    out["validated"] = {"a": a, "b": b, "val_acc": acc,
                        "test_acc": float((projection_cosine(P, test_f).argmax(1) == owner).double().mean())}
    return out


# ---------------------------------------------------------------- report


def _ms(values) -> str:
    return fmt_mean_std(list(values), 1.0, 3)


def summarise(runs: list[dict]) -> dict:
    """runs -> {setting: {model: {backbone: {"prototype": [..], "projection": {b: {a: [..]}}}}}} (one value a seed)."""
    out: dict = {}
    for r in runs:
        cell = out.setdefault(r["setting"], {}).setdefault(r["model"], {}).setdefault(
            r["backbone"], {"prototype": [], "projection": {}, "validated": [], "validated_choice": []})
        cell["prototype"].append(r["prototype"])
        cell["validated"].append(r["validated"]["test_acc"])
        cell["validated_choice"].append([r["validated"]["a"], r["validated"]["b"]])
        for b, row in r["projection"].items():
            for a, acc in row.items():
                cell["projection"].setdefault(b, {}).setdefault(a, []).append(acc)
    return out


def _best(row: dict) -> tuple[str, np.ndarray]:
    """The ridge of ``row`` ({a: [acc per seed]}) with the highest mean accuracy, and its accuracies."""
    a = max(row, key=lambda key: np.mean(row[key]))
    return a, np.asarray(row[a])


def facts(summary: dict, b_main: str, a_main: str) -> list[str]:
    """Plain statements computed from the numbers (no hand-picked cells)."""
    out = []
    for setting, models in summary.items():
        cells = [(m, bb, c) for m, bbs in models.items() for bb, c in bbs.items()]
        gaps = [np.mean(c["projection"][b_main][a_main]) - np.mean(c["prototype"]) for _, _, c in cells]
        wins = sum(g > 0 for g in gaps)
        best_gaps = []
        for _, _, c in cells:
            best = max(np.mean(_best(row)[1]) for row in c["projection"].values())
            best_gaps.append(best - np.mean(c["prototype"]))
        val_gaps = [np.mean(c["validated"]) - np.mean(c["prototype"]) for _, _, c in cells]
        out.append(f"- {setting}: at the headline a = {float(a_main):g}, b = {b_main}, projection beats prototype "
                   f"(in the seed mean) in {wins} of {len(cells)} model x backbone cells, by "
                   f"{min(gaps):+.3f} to {max(gaps):+.3f}; with (a, b) validated on held-out training data in "
                   f"{sum(g > 0 for g in val_gaps)} of {len(cells)}, by {min(val_gaps):+.3f} to "
                   f"{max(val_gaps):+.3f}; with the best (a, b) picked on the test set by {min(best_gaps):+.3f} "
                   f"to {max(best_gaps):+.3f}. The paper's gaps: +0.214 (MNIST) down to +0.052 (DomainNet).")
    return out


def markdown(meta: dict, summary: dict, args) -> str:
    b_main = str(args.batch_size)
    a_main = repr(HEADLINE_A)
    lines = [
        "# FedD3A Table 2 on Fashion-MNIST: projection- vs prototype-based classification",
        "",
        f"Date: {meta['date']}. Machine: {meta['machine']['cpus']} CPUs, {meta['machine']['platform']}, "
        f"torch {meta['machine']['torch']}, {meta['machine']['threads']} torch thread(s), no GPU. "
        f"Wall time: {meta['wall_s']:.0f} s.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "Setup (details in the script's docstring): one client per class of Fashion-MNIST (10 clients, 6,000 "
        "training images each) or per domain of `fmnist_domains` (5 clients: original, rotated, inverted, "
        "noisy, blurred; 12,000 training images each). Each client uploads its projection P_k (Eq. 5 over the "
        f"means of shuffled batches of b = {args.batch_size} features, ridge a) or its mean feature; the server "
        "labels each of the 10,000 test images with the client of the highest cos(u, P_k u) resp. the highest "
        "cosine to the prototype. Accuracy = share of test images given to their own class (chance 0.1) resp. "
        f"domain (chance 0.2). Seeds {', '.join(map(str, args.seeds))}: mean ± sample std. Backbones: "
        "`random` = the untrained initialisation (what FedD3A's clients hold when they compute P in round 1), "
        "`fedavg1` = after one FedAvg round of these clients (1 local epoch, SGD lr 0.05, batch 64), "
        "`pooled` = after 1 epoch of centralised training on all client data (a reference, not federated). "
        "Models: `mlp` = 784-200-200-10 (3 linear layers, 200-d features), `lenet5` (84-d features).",
        "",
        f"## Headline: a = {HEADLINE_A:g} (the paper's P = I - P_hat), b = {args.batch_size}",
        "",
        f"validated: (a, b) chosen per seed on {VAL_SHARE:.0%} of each client's data held out (projections "
        f"fitted on the other {1 - VAL_SHARE:.0%}), then scored on the test set; the chosen (a, b) per seed in "
        "brackets. best: the sweep's best mean test accuracy, (a, b) picked on the test set itself "
        "(optimistic).",
        "",
        "| setting | model | backbone | prototype-based | projection-based | proj. − proto. | validated proj. "
        "| validated (a, b) | best proj. | best (a, b) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, models in summary.items():
        for model, bbs in models.items():
            for bb, cell in bbs.items():
                proto = np.asarray(cell["prototype"])
                proj = np.asarray(cell["projection"][b_main][a_main])
                best_b = max(cell["projection"], key=lambda b: np.mean(_best(cell["projection"][b])[1]))
                best_a, best_acc = _best(cell["projection"][best_b])
                chosen = "; ".join(f"({a:g}, {b})" for a, b in cell["validated_choice"])
                lines.append(f"| {setting} | {model} | {bb} | {_ms(proto)} | {_ms(proj)} | "
                             f"{(proj - proto).mean():+.3f} | {_ms(cell['validated'])} | {chosen} | "
                             f"{_ms(best_acc)} | ({float(best_a):g}, {best_b}) |")
    lines += ["", "The paper's Table 2 (other datasets and models, NOT Fashion-MNIST; how its backbones were "
              "trained is not stated, a unspecified):", "",
              "| dataset, backbone | prototype-based | projection-based | proj. − proto. |", "|---|---|---|---|"]
    for name, ((pm, ps), (qm, qs)) in PAPER.items():
        lines.append(f"| {name} | {pm:.3f} ± {ps:.3f} | {qm:.3f} ± {qs:.3f} | {qm - pm:+.3f} |")
    for setting, models in summary.items():
        lines += ["", f"## Sweep, {setting}: projection-based accuracy by batch size b and ridge a", "",
                  "b = 1: every feature is a row of Z (no batch means). Prototype-based for comparison.", "",
                  "| model | backbone | b | " + " | ".join(f"a = {float(a):g}" for a in args.ridges)
                  + " | prototype |",
                  "|---|---|---|" + "---|" * (len(args.ridges) + 1)]
        for model, bbs in models.items():
            for bb, cell in bbs.items():
                for b, row in cell["projection"].items():
                    lines.append(f"| {model} | {bb} | {b} | " + " | ".join(_ms(row[repr(float(a))])
                                 for a in args.ridges) + f" | {_ms(cell['prototype'])} |")
    lines += ["", "## Computed comparison", ""] + facts(summary, b_main, a_main) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--backbones", nargs="+", choices=BACKBONES, default=list(BACKBONES))
    ap.add_argument("--ridges", type=float, nargs="+", default=list(RIDGES))
    ap.add_argument("--batch-size", type=int, default=256, help="Eq. 5's batch size (the paper's: 256)")
    ap.add_argument("--also-b1", action=argparse.BooleanOptionalAction, default=True,
                    help="also project onto every feature (b=1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--no-write", action="store_true", help="print only; leave the results folder alone")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where subspace_fmnist.md and .json go")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild subspace_fmnist.md from the runs recorded in OUT/subspace_fmnist.json")
    args = ap.parse_args(argv)
    if args.report_only:
        record = json.loads((args.out / "subspace_fmnist.json").read_text())
        st = record["settings"]
        args.seeds, args.ridges, args.batch_size = st["seeds"], st["ridges"], st["batch_sizes"][0]
        meta = {k: v for k, v in record.items() if k not in ("summary", "runs")}
        md = markdown(meta, summarise(record["runs"]), args)
        (args.out / "subspace_fmnist.md").write_text(md)
        print(md)
        return
    args.ridges = [float(a) for a in args.ridges]
    if HEADLINE_A not in args.ridges:
        args.ridges = sorted({*args.ridges, HEADLINE_A})
    torch.set_num_threads(args.threads)
    batch_sizes = [args.batch_size] + ([1] if args.also_b1 and args.batch_size != 1 else [])
    t0 = time.time()
    runs = []
    for setting in args.settings:
        data = load_setting(setting, args.data_dir)
        for model_name in args.models:
            for bb in args.backbones:
                for seed in args.seeds:
                    t = time.time()
                    model = make_backbone(model_name, bb, data, seed)
                    t_train = time.time() - t
                    res = evaluate(model, data, seed, args.ridges, batch_sizes)
                    rec = {"setting": setting, "model": model_name, "backbone": bb, "seed": seed,
                           "train_s": round(t_train, 2), "total_s": round(time.time() - t, 2), **res}
                    runs.append(rec)
                    print(f"{setting:8s} {model_name:6s} {bb:8s} s{seed}  proto {res['prototype']:.3f}  proj "
                          + " ".join(f"b{b}:" + ",".join(f"{v:.3f}" for v in row.values())
                                     for b, row in res["projection"].items())
                          + f"  ({rec['total_s']:.1f}s)", flush=True)
    summary = summarise(runs)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "device": "cpu",
                    "torch": torch.__version__, "threads": args.threads},
        "command": " ".join(["OMP_NUM_THREADS=1 .venv/bin/python benchmarks/papers/subspace_fmnist.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "wall_s": round(time.time() - t0, 1),
        "settings": {"seeds": args.seeds, "ridges": args.ridges, "batch_sizes": batch_sizes,
                     "headline_a": HEADLINE_A, "lr": LR, "train_batch": TRAIN_BATCH, "std": "sample (ddof=1)"},
        "paper_table2": {k: {"prototype": v[0], "projection": v[1]} for k, v in PAPER.items()},
    }
    md = markdown(meta, summary, args)
    if args.no_write:
        print(md)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "subspace_fmnist.json").write_text(json.dumps({**meta, "summary": summary, "runs": runs},
                                                              indent=1) + "\n")
    (args.out / "subspace_fmnist.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
