"""Attacks and defences on Fashion-MNIST: do the federated-distillation methods resist malicious clients better than
parameter averaging, and which robust aggregation rule helps each method (issue: adversaries benchmark)?

Setting: real Fashion-MNIST, Dirichlet alpha = 0.5, 20 % of the registered clients malicious
(``adversary.fraction=0.2``: round(0.2 K) of them, drawn by the run's seed and fixed for the run), ``--rounds``
rounds (30, quickstart's) for every method, ``--seeds`` (0 1 2). Each method on its own Fashion-MNIST preset's budget:

- ``fedavg`` (McMahan et al. 2017): ``quickstart``: K = 20, 8 a round, LeNet-5, 20 local SGD steps of batch 32,
  lr 0.01, momentum 0.9, evaluated every round;
- ``feddf`` (Lin et al., NeurIPS 2020): the same, and the server distils the clients' ensemble on 500 unlabelled
  training images a class (dafkd_fmnist's FedDF proxy: the images stay in the clients' data, so the clients hold
  FedAvg's data);
- ``fedkf`` (Zhou et al., IoT-J 2023): ``fedkf_fmnist`` at fedkf_fmnist.py's CPU budget (K = 20, 4 a round, 16
  local SGD steps of batch 64 at lr 0.05, 16 generated samples a step, evaluated every 2 rounds), its OCA model
  reported;
- ``fedcd`` (Ahmad and Aral): ``fedcd_fmnist`` (K = 10, all every round, 50 labelled holdout images a class, SGD
  lr 0.05, 10 local steps, evaluated every 2 rounds) with LeNet-5 for every user (FedCD_basic's one architecture,
  the others' model; the preset's ten architectures cost ~10x a round), accuracy the mean of its personal models';
- ``fedcd_uniform``: the same with ``algorithm.ensemble=uniform``, the plain average of the clients' logits as the
  teacher instead of Eq. 4's fitted weights: the FedCD whose teacher a robust rule may replace.
FedDF rather than FedD3A: FedD3A's Fashion-MNIST preset splits by domain (fmnist_domains), not by Dirichlet alpha.

Attacks (``adversary.attack``; docs/adversaries.md): ``none``; ``sign_flip`` (Damaskinos et al. 2018; Fang et al.,
USENIX Security 2020) scaled by 3; ``lie`` (Baruch et al., NeurIPS 2019) with the benign statistics of every honest
upload of the step (``adversary.estimate=omniscient``); ``backdoor`` (BadNets, Gu et al. 2017: the malicious clients'
images stamped with a trigger and relabelled to class 0; in federated learning as Sun et al. 2019 read it), whose figure
is ``eval/attack_success``; ``forge_logits`` (the target's logit raised above every row's largest) for the methods that
upload logits. Rules (``aggregation.rule``): ``mean``; ``median`` and ``trimmed_mean`` (Yin et al., ICML 2018); ``krum``
(Blanchard et al., NeurIPS 2017). f = the malicious clients expected in a round, rounded up (ceil(0.2 x clients a
round): 2 of FedAvg's 8, within Krum's 2f + 2 < n); the trimmed mean drops f / n of each end (beta = 0.25: Yin et al.'s
beta >= the Byzantine share: 0.25 of FedAvg's, FedDF's and FedKF's, 0.2 of FedCD's 10). Each method takes the
rules its class says (``robust_rules``, docs/adversaries.md): FedAvg every one; FedDF the rules over its fused model's
start and over its teacher, the clients' logit tables; FedKF over its ACA and OCA models (not Krum: its 4 uploads a
round are too few for f = 1, REFUSED_RULES); FedCD with Eq. 4 only the mean (its teacher is fitted weights, not a mean),
with ``ensemble=uniform`` every rule over its teacher. A (method, attack) whose upload has nothing the attack forges
is not in the grid either (REFUSED_ATTACKS says why; tests/test_benchmarks.py checks every cell of the cross product
validates or is one of these). The grid: FedAvg and FedDF 4 attacks x 4 rules, FedKF 4 x 3, FedCD 3 attacks (none,
backdoor, forged logits) x the mean, FedCD uniform 3 x 4: 59 cells, 177 runs with 3 seeds.

The record (``OUT/adversaries_fmnist.md`` and ``.json``): per method, each cell's accuracy (mean of the last 5
evaluations, mean ± std over seeds), minus its no-attack cell under the same rule and minus the mean under the same
attack (both paired by seed, only between runs one machine made: ``harness.paired_by_seed``), the attack's success
(``eval/attack_success``, last 5; "—" where a run has no such figure), the malicious uploads a round and Krum's kept
ones; then the two readings, computed from those numbers: each distillation method's loss under an attack against
FedAvg's (both under the mean), and which rule helps each method against each attack.

The grid runs through harness.py, seed by seed (a stopped benchmark has every cell of the seeds it reached): one
folder per run in ``--runs-dir``, finished runs skipped, stopped ones resumed, ``--jobs`` at a time.

    .venv/bin/python benchmarks/papers/adversaries_fmnist.py --jobs 2            # the grid
    .venv/bin/python benchmarks/papers/adversaries_fmnist.py --report-only       # the record from the runs
    .venv/bin/python benchmarks/papers/adversaries_fmnist.py --rounds 2 --seeds 0 --settings none-mean \
        sign_flip-krum --out /tmp/adv --runs-dir /tmp/adv/runs                   # smoke

Cost on the shared 2-core CPU, one thread a run, from a 2-round smoke run of each method (2026-12-06, Intel Xeon VM,
both cores busy with other benchmarks; seconds a round with its evaluation): FedAvg ~1.5, FedCD ~2.8, FedDF ~6,
FedKF ~7. At 30 rounds a run takes ~0.8, 1.4, 3 and 3.5 min; the grid, 48 FedAvg runs (~0.6 h), 9 FedCD (~0.2 h),
12 FedDF (~0.6 h) and 12 FedKF (~0.7 h), ~2.1 CPU hours, ~1.1 h with ``--jobs 2``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

import harness
from harness import Finished, Run, fmt_mean_std

NAME = "adversaries_fmnist"
ALPHA = 0.5
FRACTION = 0.2  # the 20 % malicious clients
# FedDF's proxy data as dafkd_fmnist's: 500 unlabelled training images a class, kept in the clients' data
FEDDF_PROXY = {"data.server_data.kind": "holdout", "data.server_data.per_class": 500,
               "data.server_data.labelled": False, "data.server_data.keep_in_training": True}
FEDCD_LENET = {"model.client_models": None, "model.name": "lenet5", "federation.eval_every": 2}
# method -> (its Fashion-MNIST preset, what changes: dotted keys, "algorithm" a whole section)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("quickstart", {}),
    # fedkf_fmnist.py's CPU budget (its docstring says why: the local generator dominates a round)
    "fedkf": ("fedkf_fmnist", {"federation.local_epochs": None, "federation.local_steps": 16,
                               "federation.lr": 0.05, "algorithm.generator_batch_size": 16,
                               "federation.eval_every": 2, "federation.eval_batch_size": 256}),
    # one architecture (LeNet-5) for every user: FedCD_basic's shape at the others' model and a CPU's cost
    "fedcd": ("fedcd_fmnist", FEDCD_LENET),
    # the plain average of the clients' logits as the teacher (Eq. 4's weights off): the FedCD whose teacher a rule
    # may replace
    "fedcd_uniform": ("fedcd_fmnist", {**FEDCD_LENET, "algorithm.ensemble": "uniform"}),
    "feddf": ("quickstart", {"algorithm": {"name": "feddf"}, **FEDDF_PROXY}),
}
DISTILLATION = ("fedkf", "fedcd", "fedcd_uniform", "feddf")  # read against FedAvg's averaging
ATTACKS: dict[str, dict[str, Any]] = {
    "none": {},
    # scaled by 3: a plain flip from 20 % of the clients only shrinks the mean's step to (1 - 2 x 0.2) = 0.6 of the
    # honest one, a slowdown the mean absorbs; at 3, a round with 2 of 8 malicious steps nowhere ((8 - 4 x 2) / 8)
    # and one with 3 backwards, while the flipped updates stay outliers a robust rule can see
    "sign_flip": {"adversary.attack": "sign_flip", "adversary.scale": 3.0},
    # every honest upload's statistics: with the paper's own estimate, a step with one malicious upload has sigma = 0
    # and sends that client's honest update; with 4 of 20 clients malicious, that is 74 % of FedKF's attacked rounds
    # (4 a round) and 40 % of FedAvg's (8), so the cells would measure mostly no attack
    "lie": {"adversary.attack": "lie", "adversary.estimate": "omniscient"},
    "backdoor": {"adversary.attack": "backdoor"},  # target class 0, half the samples stamped, a 3-pixel trigger
    "forge_logits": {"adversary.attack": "forge_logits"},  # target class 0, margin 5
}
RULES = ("mean", "median", "trimmed_mean", "krum")
# (method, attack) pairs not in the grid: what the method uploads gives the attack nothing to forge. The first three
# stop in one line at the first malicious upload (fedray/adversary/forge.py); FedCD under LIE runs, its uploads sent
# as trained (fedray/adversary/collude.py forges model fields only): a cell that would read as FedCD resisting LIE
REFUSED_ATTACKS: dict[tuple[str, str], str] = {
    ("fedavg", "forge_logits"): "FedAvg uploads a model, no logits (refused at the first malicious upload)",
    ("fedkf", "forge_logits"): "FedKF uploads a model, no logits (refused at the first malicious upload)",
    ("feddf", "forge_logits"): "FedDF uploads a model, no logits (refused at the first malicious upload)",
    **{(m, "sign_flip"): "FedCD uploads logits, no model updated from the payload (refused at the first malicious "
                         "upload)" for m in ("fedcd", "fedcd_uniform")},
    **{(m, "lie"): "FedCD uploads logits, no model updated from the payload (refused at the first server step with "
                   "a malicious upload)" for m in ("fedcd", "fedcd_uniform")},
}
# (method, rule) pairs the method takes but its budget cannot (aggregation.* refuses them: one line, before any work)
REFUSED_RULES: dict[tuple[str, str], str] = {
    ("fedkf", "krum"): "FedKF's 4 uploads a round are too few for Krum with f = 1 (it needs 2f + 2 < n)",
}
KEYS = {"accuracy": "eval/accuracy", "attack_success": "eval/attack_success"}
NOISE = 2.0  # a difference reads as one when it exceeds this many standard errors (dafkd_fmnist's rule)


def setting_name(attack: str, rule: str) -> str:
    return f"{attack}-{rule}"


def split_setting(setting: str) -> tuple[str, str]:
    attack, _, rule = setting.partition("-")
    return attack, rule


SETTINGS = [setting_name(a, r) for a in ATTACKS for r in RULES]


@functools.lru_cache(maxsize=None)
def taken(method: str) -> tuple[tuple[str, ...], str]:
    """The rules ``method``'s config takes (its class's ``robust_rules`` for its parameters: the others are refused
    before any work, fedray/methods/registry.py's check_declarations), and why no others."""
    from fedray.methods import get_algorithm

    preset, spec = METHODS[method]
    cfg = harness.preset_config(preset, spec, {"tracking.enabled": False})
    algorithm = get_algorithm(cfg.algorithm.name)
    return algorithm.robust_rules(algorithm.parse_params(cfg.algorithm.params()))


def rules_of(method: str) -> tuple[str, ...]:
    """The rules of RULES in ``method``'s grid: those it takes, less REFUSED_RULES."""
    return tuple(r for r in RULES if r in taken(method)[0] and (method, r) not in REFUSED_RULES)


def grid() -> dict[str, list[str]]:
    """method -> its settings (attack-rule), in ATTACKS' then RULES' order."""
    return {m: [setting_name(a, r) for a in ATTACKS if (m, a) not in REFUSED_ATTACKS for r in rules_of(m)]
            for m in METHODS}


def planned(runs_dir: Path, methods, settings, seeds) -> list[Run]:
    """The grid's runs of the asked methods, settings and seeds, seed by seed."""
    cells = grid()
    return [Run(m, s, seed, Path(runs_dir) / harness.run_name(m, s, seed)) for seed in seeds for s in settings
            for m in methods if s in cells[m]]


def rule_overrides(rule: str, per_round: int) -> dict[str, Any]:
    """``aggregation.*`` of ``rule`` for ``per_round`` uploads a step: Krum's f and the trimmed mean's beta from the
    malicious clients expected among them, rounded up."""
    f = math.ceil(FRACTION * per_round - 1e-9)  # 0.2 x 10 is 2.0000000000000004 in floats: 2, not 3
    if rule == "krum":
        return {"aggregation.rule": "krum", "aggregation.f": f}
    if rule == "trimmed_mean":
        return {"aggregation.rule": "trimmed_mean", "aggregation.beta": f / per_round}
    return {"aggregation.rule": rule}


def make_config(method: str, setting: str, seed: int, rounds: int, device: str = "cpu"):
    """The run's checked config (raises ConfigError for a refused cell)."""
    from fedray.load import load_config

    preset, spec = METHODS[method]
    attack, rule = split_setting(setting)
    per_round = load_config(preset).federation.clients_per_round
    adversary = {**ATTACKS[attack], **({"adversary.fraction": FRACTION} if attack != "none" else {})}
    return harness.preset_config(preset, spec, {
        "name": f"bench_{method}", "seed": seed, "data.alpha": ALPHA, "federation.rounds": rounds,
        "tracking.enabled": False, "runtime.backend": "local", "runtime.device": device, **adversary,
        **rule_overrides(rule, per_round)})


def build(run: Run, opts: dict):
    return make_config(run.method, run.setting, run.seed, opts["rounds"], opts["device"])


# --- reading the runs ------------------------------------------------------------------------------------------


def _mean_of(history: list[dict], key: str) -> float | None:
    from fedray.report.runs import as_number

    vals = [v for v in (as_number(r.get(key)) for r in history) if v is not None]
    return float(np.mean(vals)) if vals else None


def collect(found: dict[tuple[str, str], list[Finished]]) -> dict[str, list[dict]]:
    """``method|setting`` -> each finished run's figures, in seed order."""
    out: dict[str, list[dict]] = {}
    for (method, setting), recs in found.items():
        for f in recs:
            out.setdefault(f"{method}|{setting}", []).append({
                "seed": f.seed, "dir": harness.shown(f.run.out), "cpu": harness.run_machine(f.run.out),
                **{name: harness.last_n(f.history, key) for name, key in KEYS.items()},
                "malicious_uploads": _mean_of(f.history, "adv/malicious_uploads"),
                "malicious_kept": _mean_of(f.history, "adv/malicious_kept"),
                "round_s": f.summary.get("time/round_s")})
    return out


def _by_seed(recs: list[dict], key: str) -> dict[int, float]:
    return {r["seed"]: 100 * r[key] for r in recs if r.get(key) is not None}


def _cpus(recs: list[dict]) -> dict[int, str | None]:
    return {r["seed"]: r.get("cpu") for r in recs}


def paired(res: dict, method: str, a: str, b: str, key: str = "accuracy") -> harness.Paired | str | None:
    """``method``'s setting ``a`` minus setting ``b`` in points of ``key``, paired by seed on one machine."""
    ra, rb = res.get(f"{method}|{a}", []), res.get(f"{method}|{b}", [])
    return harness.paired_by_seed(_by_seed(ra, key), _by_seed(rb, key), (_cpus(ra), _cpus(rb)))


def _mean_cell(recs: list[dict], key: str, digits: int = 2) -> str:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return f"{np.mean(vals):.{digits}f}" if vals else "—"


def method_table(res: dict, method: str, seeds: int) -> list[str]:
    """One row per cell of ``method``'s grid; "—" where no run (or no such figure) is."""
    preset, _ = METHODS[method]
    rules = rules_of(method)
    lines = [f"### {method} (preset `{preset}`; rules: {', '.join(rules)})", "",
             "| attack | rule | seeds | accuracy, last 5 (%) | minus no attack, same rule | minus the mean, same "
             "attack | attack success, last 5 (%) | malicious uploads a round | of them kept by Krum |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for setting in grid()[method]:
        attack, rule = split_setting(setting)
        recs = res.get(f"{method}|{setting}", [])
        vs_none = "" if attack == "none" else harness.fmt_paired(paired(res, method, setting,
                                                                         setting_name("none", rule)), seeds)
        vs_mean = "" if rule == "mean" else harness.fmt_paired(paired(res, method, setting,
                                                                       setting_name(attack, "mean")), seeds)
        lines.append(f"| {attack} | {rule} | {len(recs)} | {fmt_mean_std([r['accuracy'] for r in recs])} | {vs_none} | "
                     f"{vs_mean} | {fmt_mean_std([r['attack_success'] for r in recs])} | "
                     f"{_mean_cell(recs, 'malicious_uploads')} | "
                     f"{_mean_cell(recs, 'malicious_kept') if rule == 'krum' else ''} |")
    return lines


def _reading(diff: float, se: float | None, n: int, better: str, worse: str) -> str:
    if n < 2 or se is None:
        return f"{n} seed{'s' if n != 1 else ''}: no reading"
    if abs(diff) <= NOISE * se:
        return "within noise"
    return better if diff > 0 else worse


def _unpaired(a: list[float], b: list[float]) -> tuple[float, float | None, int]:
    """mean(a) - mean(b), the standard error of that difference (None under 2 values a side), the smaller n."""
    n = min(len(a), len(b))
    if n < 2:
        return float(np.mean(a) - np.mean(b)), None, n
    se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
    return float(np.mean(a) - np.mean(b)), se, n


def resistance(res: dict) -> list[str]:
    """Reading 1: each distillation method's loss under an attack (its cell minus its no-attack cell, both under the
    mean) against FedAvg's; under the backdoor also its attack success against FedAvg's."""
    lines = ["## Do the distillation methods resist better than averaging?", "",
             "Each method's loss under an attack: its accuracy minus its own no-attack run, both under the mean, "
             "paired by seed (points; ± standard error). A distillation method minus FedAvg: the difference of the "
             "two losses, ± the two standard errors combined; *resists better* when it loses fewer points by more "
             f"than {NOISE:g} standard errors, *resists worse* when more, *within noise* otherwise. Under the "
             "backdoor, the attack's success too (method minus FedAvg, unpaired, points; lower resists better). The "
             "methods start from different clean accuracies (their own budgets): the loss is in points of each one's "
             "own.", "",
             "| method | attack | its loss | FedAvg's loss | method − FedAvg | reading | attack success − FedAvg's "
             "| reading |", "| --- | --- | ---: | ---: | ---: | --- | ---: | --- |"]
    cells = grid()
    summary: dict[str, dict[str, list[str]]] = {}
    for m in DISTILLATION:
        for attack in ATTACKS:
            setting = setting_name(attack, "mean")
            if attack == "none" or setting not in cells[m]:
                continue
            own = paired(res, m, setting, "none-mean")
            if setting not in cells["fedavg"]:
                lines.append(f"| {m} | {attack} | {harness.fmt_paired(own)} | — (not in FedAvg's grid: below) | | "
                             "no reading | | |")
                continue
            avg = paired(res, "fedavg", setting, "none-mean")
            if isinstance(own, tuple) and isinstance(avg, tuple):
                diff = own[0] - avg[0]
                se = None if own[1] is None or avg[1] is None else math.sqrt(own[1] ** 2 + avg[1] ** 2)
                n = min(own[2], avg[2])
                read = _reading(diff, se, n, "resists better", "resists worse")
                text = f"{diff:+.2f}" + (f" ± {se:.2f}" if se is not None else "")
                if read in ("resists better", "resists worse", "within noise"):
                    summary.setdefault(m, {}).setdefault(read, []).append(attack)
            else:
                read, text = "no reading", "—"
            asr_text, asr_read = "", ""
            if attack == "backdoor":
                a = [100 * r["attack_success"] for r in res.get(f"{m}|{setting}", [])
                     if r.get("attack_success") is not None]
                b = [100 * r["attack_success"] for r in res.get(f"fedavg|{setting}", [])
                     if r.get("attack_success") is not None]
                if a and b:
                    d, s, n = _unpaired(a, b)
                    asr_text = f"{d:+.2f}" + (f" ± {s:.2f}" if s is not None else "")
                    asr_read = _reading(-d, s, n, "resists better", "resists worse")
                else:
                    asr_text, asr_read = "—", "no reading"
            lines.append(f"| {m} | {attack} | {harness.fmt_paired(own)} | {harness.fmt_paired(avg)} | {text} | "
                         f"{read} | {asr_text} | {asr_read} |")
    lines.append("")
    for m in DISTILLATION:
        got = summary.get(m, {})
        if got:
            lines.append(f"- {m} against FedAvg, accuracy lost: " + "; ".join(
                f"{read}: {', '.join(attacks)}" for read, attacks in got.items()) + ".")
        else:
            lines.append(f"- {m} against FedAvg: no reading yet (it needs an attack both have run with 2 seeds or "
                         "more on one machine).")
    return lines + [""]


def defences(res: dict) -> list[str]:
    """Reading 2: per method and attack, each robust rule minus the mean under that attack (paired), the rules that
    help by more than NOISE standard errors, the one that helps most; each rule's cost without an attack; and the
    methods no robust rule is available to."""
    lines = ["## Which defence helps each method", "",
             "A rule *helps* against an attack when its accuracy under the attack minus the mean's, paired by seed, "
             f"exceeds {NOISE:g} standard errors (under the backdoor, also when it lowers the attack's success by "
             "as much); the rule that helps most has the largest gain in accuracy (under the backdoor: the largest "
             "drop in the attack's success, where the runs have that figure). *Hurts*: a loss beyond the same bound. "
             "A rule's cost: its accuracy minus the mean's without an attack.", ""]
    cells = grid()
    for m in METHODS:
        robust = [r for r in rules_of(m) if r != "mean"]
        if not robust:
            lines.append(f"- {m}: no defence available: it takes only the mean ({', '.join(RULES[1:])} refused: "
                         f"{taken(m)[1]}), so it meets every attack undefended.")
            continue
        cost = "; ".join(f"{r} {harness.fmt_paired(paired(res, m, setting_name('none', r), 'none-mean'))}"
                         for r in robust)
        lines.append(f"- {m}, cost without an attack: {cost}.")
        for attack in ATTACKS:
            if attack == "none" or setting_name(attack, "mean") not in cells[m]:
                continue
            parts, helping, read = [], [], False
            for r in robust:
                p = paired(res, m, setting_name(attack, r), setting_name(attack, "mean"))
                text = f"{r} {harness.fmt_paired(p)}"
                read |= isinstance(p, tuple) and p[1] is not None
                helps = isinstance(p, tuple) and _reading(p[0], p[1], p[2], "helps", "hurts") == "helps"
                # under the backdoor what a rule is for is the trigger's success: ranked by how far it lowers it
                rank = p[0] if isinstance(p, tuple) else -math.inf
                if attack == "backdoor":
                    q = paired(res, m, setting_name(attack, r), setting_name(attack, "mean"), "attack_success")
                    text += f" (attack success {harness.fmt_paired(q)})"
                    if isinstance(q, tuple):
                        read |= q[1] is not None
                        helps |= _reading(-q[0], q[1], q[2], "helps", "") == "helps"
                        rank = -q[0]
                if isinstance(p, tuple) and p[1] is not None and p[0] < -NOISE * p[1]:
                    text += ", hurts"
                parts.append(text)
                if helps:
                    helping.append((rank, r))
            verdict = (f"helps most: {max(helping)[1]}; helps: {', '.join(r for _, r in helping)}" if helping
                       else "no rule helps by more than the noise" if read else "no reading yet")
            lines.append(f"  - {attack}: " + "; ".join(parts) + f". {verdict[0].upper()}{verdict[1:]}.")
    return lines + [""]


def refusals() -> list[str]:
    """What the grid leaves out, and why: said, not silently omitted."""
    lines = ["## Not in the grid, and why", ""]
    for m in METHODS:
        if rules_of(m) == ("mean",):
            lines.append(f"- {m}: {', '.join(RULES[1:])} not available: it takes only the mean (`aggregation.rule` "
                         f"is refused before any work: {taken(m)[1]}), so its defences are not measured here.")
    for (m, rule), why in REFUSED_RULES.items():
        lines.append(f"- {m} with {rule}: {why}.")
    for (m, attack), why in REFUSED_ATTACKS.items():
        lines.append(f"- {m} under {attack}: {why}.")
    return lines + [""]


def settings_of(found: dict[tuple[str, str], list[Finished]]) -> list[str]:
    """Each method's budget, from the config of one of its finished runs."""
    lines = []
    for m in METHODS:
        recs = [f for (method, _), fs in found.items() if method == m for f in fs]
        if not recs:
            continue
        p = recs[0].params
        get = lambda k: p.get(k, "?")  # noqa: E731
        lines.append(f"- {m}: {get('model.name')}, K = {get('data.num_clients')}, "
                     f"{get('federation.clients_per_round')} a round, {get('federation.local_steps')} local steps of "
                     f"batch {get('federation.batch_size')}, "
                     f"{get('federation.optimizer')} lr {get('federation.lr')}, {get('federation.rounds')} rounds, "
                     f"evaluated every {get('federation.eval_every')}, α = {get('data.alpha')}.")
    return ["Each method's budget (from its runs' configs):", "", *lines, ""] if lines else []


def machines(res: dict) -> list[str]:
    counts: dict[str, int] = {}
    for recs in res.values():
        for r in recs:
            counts[r.get("cpu") or "not recorded"] = counts.get(r.get("cpu") or "not recorded", 0) + 1
    if not counts:
        return []
    return ["Machines (each run folder's `machine.json`): " + ", ".join(f"{c} {n} runs" for c, n in counts.items())
            + ".", ""]


def markdown(res: dict, found: dict, meta: dict, runs_dir: Path, planned_runs: list[Run], seeds: int) -> str:
    lines = harness.header(f"Attacks and defences on Fashion-MNIST α = {ALPHA:g}, {FRACTION:.0%} malicious clients",
                           meta, NAME, runs_dir, planned_runs) + machines(res) + settings_of(found)
    lines += [f"Accuracy: `{KEYS['accuracy']}` (FedKF: its OCA model; FedCD: the mean of its personal models'), the "
              f"mean of a run's last {harness.LAST_N} evaluations, then mean ± std over seeds. Attack success: "
              f"`{KEYS['attack_success']}`, the same way (— where the runs have no such figure). Differences: "
              "points, paired by seed, only between runs one machine made; ± the standard error; n when not "
              f"{seeds} seeds. Malicious uploads a round and those Krum kept: `adv/malicious_uploads`, "
              "`adv/malicious_kept`, mean over rounds and seeds.", "", "## Each method's cells", ""]
    for m in METHODS:
        lines += method_table(res, m, seeds) + [""]
    lines += harness.stopped(planned_runs, "the attack", " (`health/rejected_updates` counts the rounds before)")
    lines += resistance(res) + defences(res) + refusals()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.grid_args(ap, NAME, list(METHODS), SETTINGS, rounds=30)
    # an attack that makes a model diverge stops its run (every upload non-finite): an outcome of the cell, recorded
    args, meta, table_runs, found = harness.run_planned(NAME, ap, sys.argv[1:] if argv is None else argv, planned,
                                                        build, failures_are_results=True)
    res = collect(found)
    md = markdown(res, found, meta, args.runs_dir, table_runs, len(ap.get_default("seeds")))
    harness.write(args.out, NAME, meta, {"grid": grid(), "refused_attacks": {f"{m}|{a}": why for (m, a), why
                                                                              in REFUSED_ATTACKS.items()},
                                         "refused_rules": {f"{m}|{r}": why for (m, r), why in REFUSED_RULES.items()},
                                         "runs": res}, md)
    print(md)


if __name__ == "__main__":
    main()
