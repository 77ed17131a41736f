"""Why the heterogeneous FedD3A run of ``fedd3a_fmnist_domains.py`` stays at chance: each client model as a teacher
on the server's (blurred) domain, round by round.

Runs ``--rounds`` rounds of the benchmark's ``fedd3a_hetero`` cross-silo setting in-process and prints, per
round and client, the architecture, the local loss, and the teacher's accuracy on the server's images (from
the labels the simulation keeps; the method never reads them), its mean top probability and how many of the
server's images it puts in its most predicted class; then the plain average's accuracy. Writes the table, with
when, where and how it was made, to ``OUT/fedd3a_hetero_probe.md``.

    .venv/bin/python benchmarks/papers/fedd3a_hetero_probe.py --rounds 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import harness
from fedd3a_fmnist_domains import make_config


def main(argv: list[str] | None = None) -> None:
    from fedray.learning.proxy_distill import teacher_logits
    from fedray.data import build_federated_data
    from fedray.runtime.core import ClientWorkerCore
    from fedray.runtime.server_core import ServerCore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=harness.RESULTS, help="where fedd3a_hetero_probe.md goes")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    meta = harness.invocation("fedd3a_hetero_probe", argv, "cpu")
    lines = ["# Heterogeneous FedD3A: each client model as a teacher on the server's domain", "",
             f"Recorded {meta['date']} at commit {meta['commit']} on {meta['device']}.",
             f"Command: `{meta['command']}`", "",
             "`fedd3a_hetero`, cross-silo, seed " + str(args.seed) + ": accuracy on the server's (blurred) images "
             "from the labels the simulation keeps; top class share: the share of those images in the model's "
             "most predicted class.", ""]
    torch.set_num_threads(1)
    cfg = make_config("fedd3a_hetero", "cross_silo", args.seed, args.rounds, "cpu")
    data = build_federated_data(cfg.data, cfg.seed)
    cpu = torch.device("cpu")
    server, worker = ServerCore(cfg, data, cpu), ClientWorkerCore(cfg, data, cpu)
    algo, x, y = server.algo, server.algo.server_data.x, server.server_labels
    clients = list(range(data.num_clients))
    states: dict[int, object] = {}
    lines += ["| round | client | architecture | train/loss | acc on server domain | mean top prob | top class share |",
              "|---:|---:|---|---:|---:|---:|---:|"]
    for rnd in range(1, args.rounds + 1):
        payload, _ = server.payload(rnd - 1)
        uploads, losses = [], []
        for c in clients:
            up, states[c], info, _ = worker.train(rnd, c, payload, states.get(c))
            uploads.append(up)
            losses.append(info["train/loss"])
        probs = teacher_logits(((server.modules.bank.get(u.architecture), u.weights) for u in uploads), x, algo.spec,
                               cfg.federation.eval_batch_size).softmax(-1)
        for c, u, loss, p in zip(clients, uploads, losses, probs):
            pred = p.argmax(1)
            lines.append(f"| {rnd} | {c} | {u.architecture} | {loss:.3f} | {float((pred == y).float().mean()):.3f} | "
                         f"{float(p.max(1).values.mean()):.3f} | {float(torch.bincount(pred).max()) / len(pred):.3f} |")
        lines.append(f"| {rnd} | average | | | {float((probs.mean(0).argmax(1) == y).float().mean()):.3f} | | |")
        print("\n".join(lines[-len(clients) - 1:]), flush=True)
        server.aggregate(rnd, uploads, clients)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fedd3a_hetero_probe.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'fedd3a_hetero_probe.md'}")


if __name__ == "__main__":
    main()
