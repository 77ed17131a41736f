"""The method-comparison benchmarks (benchmarks/papers/): their committed tables are what ``--report-only``
rebuilds from their committed run folders, and the harness plans, skips and resumes the grid it is given.
No training on real data: runs are faked where the harness would start one (the refusals of adversaries_fmnist's
left-out attacks run one round of tiny_config's synthetic data)."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAPERS = REPO / "benchmarks" / "papers"
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(PAPERS))

harness = importlib.import_module("harness")

# benchmark module -> the record its --report-only reads (OUT/<name>.json) and the table it writes
COMPARISONS = ["adversaries_fmnist", "compression_fmnist", "dafkd_decomposition", "dafkd_fmnist", "fedcd_fmnist",
               "fedd3a_table1", "fedd3a_fmnist_domains", "fedkf_fmnist", "privacy_fmnist", "subspace_fmnist",
               "system_fmnist"]
# planned and checked below, their runs not committed yet: each joins COMPARISONS with its committed runs
NOT_RUN_YET: list[str] = []


# --------------------------------------------------------------------------------------------------
# the committed tables


@pytest.mark.parametrize("name", COMPARISONS)
def test_report_only_rebuilds_the_committed_table(name, tmp_path, capsys):
    """``--report-only`` on the committed run folders (and the committed record of how they were made) writes
    the committed ``<name>.md`` byte for byte, and the same ``<name>.json``."""
    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    importlib.import_module(name).main(["--report-only", "--out", str(tmp_path)])
    capsys.readouterr()
    assert (tmp_path / f"{name}.md").read_text() == (RESULTS / f"{name}.md").read_text()
    assert json.loads((tmp_path / f"{name}.json").read_text()) == json.loads((RESULTS / f"{name}.json").read_text())


def test_every_comparison_benchmark_is_tested():
    scripts = {p.stem for p in PAPERS.glob("*.py")} - {"harness", "fedd3a_hetero_probe"}  # the probe prints only
    assert scripts == set(COMPARISONS) | set(NOT_RUN_YET)


def test_one_mean_std():
    """The tables' one format: values scaled first, None and NaN left out, sample std, 0 for one value."""
    from fedray.report.runs import fmt_mean_std

    assert harness.fmt_mean_std is fmt_mean_std
    assert fmt_mean_std([0.5, 0.6, None, float("nan")]) == "55.00 ± 7.07"
    assert fmt_mean_std([0.004, 0.006], 1e3, 3) == "5.000 ± 1.414"
    assert fmt_mean_std([0.25]) == "25.00 ± 0.00"
    assert fmt_mean_std([]) == "—"


# --------------------------------------------------------------------------------------------------
# the harness, on fake run folders


def _finished(out: Path, seed: int, accuracies=(0.5, 0.6)) -> None:
    """A run folder as ``fedray run`` leaves it, small."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"round": i + 1, "eval/accuracy": a} for i, a in enumerate(accuracies)]
    pq.write_table(pa.Table.from_pylist(rows), out / "history.parquet")
    (out / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "algorithm": {"name": "fedavg"}}))
    (out / "summary.json").write_text(json.dumps({"seed": seed, "eval/accuracy": accuracies[-1]}))


def test_plan_is_the_grid(tmp_path):
    runs = harness.plan(tmp_path, ["fedavg", "dafkd"], ["alpha0.1", "alpha1"], [0, 1, 2])
    assert len(runs) == 12 and len(set(runs)) == 12
    assert {(r.method, r.setting, r.seed) for r in runs} == {
        (m, s, seed) for m in ("fedavg", "dafkd") for s in ("alpha0.1", "alpha1") for seed in (0, 1, 2)}
    assert all(r.out == tmp_path / f"{r.method}_{r.setting}_seed{r.seed}" for r in runs)
    # setting by setting, seed by seed: a stopped grid has every method of the seeds it reached
    assert [(r.setting, r.seed) for r in runs[:2]] == [("alpha0.1", 0), ("alpha0.1", 0)]
    assert runs[0].out.name == "fedavg_alpha0.1_seed0"


def test_finished_runs_are_skipped_and_stopped_ones_resumed(tmp_path, monkeypatch):
    runs = harness.plan(tmp_path, ["a", "b"], ["s"], [0, 1])
    _finished(runs[0].out, 0)  # a_s_seed0: done
    runs[1].out.mkdir()  # b_s_seed0: stopped, with its checkpoint
    from fedray.record.checkpoint import FILENAME

    (runs[1].out / FILENAME).write_bytes(b"")
    assert harness.pending(runs) == runs[1:]

    built, started = [], []

    def fake_run(cfg, out, progress, data, resume_from):
        started.append((Path(out).name, resume_from))
        (Path(out) / "model.pt").parent.mkdir(parents=True, exist_ok=True)
        (Path(out) / "model.pt").write_bytes(b"")
        (Path(out) / "summary.json").write_text("{}")
        return SimpleNamespace(summary={"eval/accuracy": 0.5, "time/round_s": 1.0})

    monkeypatch.setattr("fedray.simulation.run_experiment", fake_run)
    ran = harness.execute(lambda run, opts: built.append(run.out.name) or "cfg", runs, {}, jobs=1)
    assert ran == 3
    assert built == ["b_s_seed0", "a_s_seed1", "b_s_seed1"]  # never the finished one
    assert started == [("b_s_seed0", runs[1].out), ("a_s_seed1", None), ("b_s_seed1", None)]
    assert not any((r.out / "model.pt").exists() for r in runs)  # models deleted unless kept
    assert harness.execute(lambda run, opts: pytest.fail("a finished run was built"), runs, {}, jobs=1) == 0


def test_collect_groups_finished_runs_by_method_and_setting(tmp_path):
    runs = harness.plan(tmp_path, ["a", "b"], ["s1", "s2"], [1, 0])
    for r in runs:
        if (r.method, r.setting) != ("b", "s2") or r.seed == 0:
            _finished(r.out, r.seed, (0.1 * (r.seed + 1), 0.2 * (r.seed + 1)))
    grid = harness.collect(runs)
    assert set(grid) == {("a", "s1"), ("b", "s1"), ("a", "s2"), ("b", "s2")}
    assert [f.seed for f in grid[("a", "s1")]] == [0, 1]  # seed order, whatever the plan's
    assert [f.seed for f in grid[("b", "s2")]] == [0]  # the unfinished seed 1 is left out
    f = grid[("a", "s1")][1]
    assert f.summary["eval/accuracy"] == 0.4 and f.params["seed"] == 1
    assert harness.last_n(f.history) == pytest.approx(0.3)


def test_the_record_survives_report_only_and_runs_that_skip(tmp_path, monkeypatch):
    recorded = {"date": "2026-01-01", "commit": "abc", "device": "CPU", "command": "old"}
    (tmp_path / "x.json").write_text(json.dumps({"meta": recorded}))
    args = SimpleNamespace(out=tmp_path, report_only=True, jobs=1, device="cpu")
    runs = harness.plan(tmp_path / "runs", ["a"], ["s"], [0])
    assert harness.run_and_record("x", [], args, None, runs, {}) == recorded
    _finished(runs[0].out, 0)
    args.report_only = False  # everything finished: nothing ran, the record stands
    assert harness.run_and_record("x", [], args, None, runs, {}) == recorded
    monkeypatch.setattr(harness, "execute", lambda *a, **k: 1)  # one run made now
    meta = harness.run_and_record("x", ["--seeds", "0"], args, None, runs, {})
    assert meta["command"] == ".venv/bin/python benchmarks/papers/x.py --seeds 0"
    assert meta["earlier"] == [recorded]
    lines = harness.header("X", meta, "x", runs[0].out.parent)
    assert any(line.startswith("Earlier runs: 2026-01-01 at commit abc") for line in lines)


def test_tables_cover_the_whole_grid_whatever_ran(tmp_path):
    """``--methods x`` runs x alone, but the tables show every finished run of the grid and name the missing
    cells; extra seeds asked for join the default ones."""
    import argparse

    ap = argparse.ArgumentParser()
    harness.grid_args(ap, "x", ["a", "b"], ["s1", "s2"], rounds=2, seeds=(0, 1))
    args = ap.parse_args(["--methods", "b", "--seeds", "2", "--runs-dir", str(tmp_path)])
    assert [(r.method, r.setting, r.seed) for r in harness.plan(args.runs_dir, args.methods, args.settings,
                                                                 args.seeds)] == [("b", "s1", 2), ("b", "s2", 2)]
    table = harness.tabled(ap, args)
    assert {(r.method, r.setting, r.seed) for r in table} == {
        (m, s, seed) for m in ("a", "b") for s in ("s1", "s2") for seed in (0, 1, 2)}
    for r in table:
        if r.method == "a" or r.seed < 2:
            _finished(r.out, r.seed)
    note = harness.not_run(table, "x")
    assert note[1] == "- b: s1 (seed 2); s2 (seed 2)"
    assert harness.not_run([r for r in table if r.method == "a"], "x") == []


def test_dependent_runs_follow_until_none_is_left(tmp_path, monkeypatch):
    """``then`` names runs that depend on finished ones (an lr chosen from earlier runs): asked again after each
    batch until it names no unfinished run; what ran counts towards the record."""
    args = SimpleNamespace(out=tmp_path, report_only=False, jobs=1, device="cpu")
    first = harness.plan(tmp_path / "runs", ["a"], ["s"], [0])
    second = harness.plan(tmp_path / "runs", ["b"], ["s"], [0])
    third = harness.plan(tmp_path / "runs", ["c"], ["s"], [0])
    batches = []

    def fake_execute(build, runs, options, jobs=1):
        batches.append([r.method for r in harness.pending(runs)])
        for r in runs:
            _finished(r.out, r.seed)
        return len(runs)

    monkeypatch.setattr(harness, "execute", fake_execute)
    # b once a has finished, c once b has
    then = lambda: second + (third if second[0].finished else []) if first[0].finished else []  # noqa: E731
    meta = harness.run_and_record("x", [], args, None, first, {}, then)
    assert batches == [["a"], ["b"], ["c"]]
    assert meta["command"] == ".venv/bin/python benchmarks/papers/x.py"


def _fedkf_run(out: Path, seed: int, final: float, val=None, suffix="") -> None:
    """A fedkf_fmnist run folder: its final global-test accuracy (of the ``suffix`` model) and val curve."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"round": i + 1, "eval/accuracy": final, f"eval/accuracy{suffix}": final, f"eval/amp{suffix}": final,
             **({"val/accuracy": v} if val is not None else {})} for i, v in enumerate(val or [None] * 5)]
    pq.write_table(pa.Table.from_pylist(rows), out / "history.parquet")
    (out / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "algorithm": {"name": "fedavg"}}))
    (out / "summary.json").write_text(json.dumps({"seed": seed, **{f"eval/{m}{suffix}": final
                                                                    for m in ("accuracy", "amp", "fm", "wlp")}}))


def test_fedkf_chooses_the_lr_on_validation_and_reruns_only_collapsed_baselines(tmp_path):
    fk = importlib.import_module("fedkf_fmnist")
    assert fk.split_method("fedavg_lr0.01") == ("fedavg", 0.01)
    assert fk.split_method("fedkf_minus") == ("fedkf_minus", None)
    seeds = [0, 1]
    sel = fk.selection_runs(tmp_path, seeds)
    assert {(r.method, r.setting) for r in sel} == {(f"fedavg_lr{lr:g}", fk.SELECT_SETTING) for lr in fk.LR_CHOICES}
    assert fk.later_runs(tmp_path, seeds, 0.05) == sel  # nothing chosen before the choice's runs finish
    # 0.02 has the best mean of the last 5 val accuracies (0.01 the best single value: the mean decides)
    best = {0.005: (0.30, 0.32), 0.01: (0.90, 0.10), 0.02: (0.60, 0.62), 0.05: (0.10, 0.11)}
    for r in sel:
        lr = fk.split_method(r.method)[1]
        _fedkf_run(r.out, r.seed, 0.5, val=[0.0] * 3 + [best[lr][r.seed]] * 5)
    assert fk.chosen_lr(tmp_path, seeds)[0] == 0.02
    # the grid at alpha 0.01: FedAvg's ACA model collapsed at seed 0, FedProx at none
    for seed in seeds:
        _fedkf_run(tmp_path / f"fedavg_alpha0.01_seed{seed}", seed, 0.1 if seed == 0 else 0.3, suffix="_aca")
        _fedkf_run(tmp_path / f"fedprox_alpha0.01_seed{seed}", seed, 0.35)
    reruns = [r for r in fk.later_runs(tmp_path, seeds, 0.05) if r not in sel]
    assert [(r.method, r.setting, r.seed) for r in reruns] == [("fedavg_lr0.02", "alpha0.01", 0),
                                                               ("fedavg_lr0.02", "alpha0.01", 1)]
    assert [r for r in fk.later_runs(tmp_path, seeds, 0.02) if r not in sel] == []  # the grid's own lr: no rerun
    row = fk.row_figures(harness.collect([harness.Run("fedavg", "alpha0.01", s, tmp_path / f"fedavg_alpha0.01_seed{s}")
                                          for s in seeds])[("fedavg", "alpha0.01")], "_aca")
    assert row["collapsed"] == [0]
    assert fk.marked("FedAvg", row) == "FedAvg † (seed 0)"


def test_fedcd_central_runs_once_per_architecture_on_all_the_data(tmp_path):
    cd = importlib.import_module("fedcd_fmnist")
    archs = cd.architectures()
    runs = cd.planned(tmp_path, ["fedcd", "central"], ["iid", "alpha0.5", "alpha0.5_r100"], [0, 1])
    central = [r for r in runs if r.method == "central"]
    assert {(r.setting, r.seed) for r in central} == {(a, s) for a in archs for s in (0, 1)}  # not per split
    assert central[0].out.name == f"central_{archs[0]}_seed0"
    long = [r for r in runs if r.setting == "alpha0.5_r100"]
    assert [(r.method, r.seed) for r in long] == [("fedcd", 0)]  # one seed, the asked methods only
    cfg = cd.make_config("central", "resnet8", 1, 30, "cpu", None)
    assert (cfg.data.partition, cfg.data.num_clients, cfg.model.name, cfg.model.client_models) == \
        ("central", 1, "resnet8", None)
    assert cfg.algorithm.name == "local" and cfg.federation.eval_every == 30
    fed = cd.make_config("fedcd", "alpha0.5", 1, 30, "cpu", None)
    # the same samples seen: the FedCD user's local steps and batch, and the same held-out validation set
    assert (cfg.federation.local_steps, cfg.federation.batch_size, cfg.federation.rounds) == \
        (fed.federation.local_steps, fed.federation.batch_size, fed.federation.rounds)
    assert cfg.data.server_data == fed.data.server_data
    assert cd.make_config("fedavg", "alpha0.5_r100", 0, 30, "cpu", None).federation.rounds == 100


def test_every_decomposition_cell_is_a_valid_config_that_changes_what_its_name_says():
    """dafkd_decomposition: each cell validates, and the ceiling on real images is the method with pooled negatives
    and real distillation images (Eq. 7 as if the generator had reached p), the reader on generated cells only."""
    dec = importlib.import_module("dafkd_decomposition")
    cfgs = {cell: dec.make_config(cell, "steps20", 0, 60, None, "cpu").algorithm.model_dump() for cell in dec.CELLS}
    ceiling, proxy = cfgs["ceiling_proxy"], cfgs["disc_proxy"]
    assert {k: v for k, v in ceiling.items() if proxy.get(k) != v} == {"disc_negatives": "pooled"}
    assert (ceiling["distill_data"], ceiling["alpha_source"]) == ("proxy", "discriminator")
    # the leak-free ceiling and its controls: each differs from its partner in the one thing its name says
    detached = cfgs["ceiling_proxy_detached"]
    assert {k: v for k, v in detached.items() if ceiling.get(k) != v} == {"disc_negatives_grad": "detached"}
    assert {k: v for k, v in detached.items() if cfgs["disc_proxy_detached"].get(k) != v} == \
        {"disc_negatives": "pooled"}
    assert {k: v for k, v in detached.items() if cfgs["uniform_ceiling_proxy_detached"].get(k) != v} == \
        {"alpha_source": "discriminator"}
    assert {c: dec.GRID["steps200"][c] for c in dec.DETACHED} == {c: (0, 1, 2) for c in dec.DETACHED}
    reader = {c for c, a in cfgs.items() if a.get("diag_reader")}
    assert {c for c in dec.CELLS if c.endswith("_generated")} <= reader  # every cell distilling on generated samples
    assert not {c for c in reader if cfgs[c].get("distill_data") == "proxy"}


def test_the_decomposition_shows_the_epochs_runs_round_by_round_and_the_mechanism(tmp_path):
    """dafkd_decomposition: an E = 20 run appears round by round with its seconds a round and its median round (a
    paused round left out), the mechanism table reads the reader's figures (in %) and, from runs recorded before the
    rename, ``diag/ens_acc_oracle`` as the label share."""
    dec = importlib.import_module("dafkd_decomposition")
    runs = dec.planned(tmp_path, ["fedavg", "disc_generated"], ["epochs20"], [0])
    for r in runs:
        _finished(r.out, 0)
        rows = [{"round": i, "eval/accuracy": 0.5 + 0.1 * i, "time/round_s": 9000.0 if i == 3 else 400.0 + i,
                 **({"diag/domain_auc": 0.6, "diag/reader_agreement": 0.25, "diag/ens_acc_oracle": 0.9}
                    if r.method != "fedavg" else {})} for i in (1, 2, 3)]  # round 3 paused
        pq.write_table(pa.Table.from_pylist(rows), r.out / "history.parquet")
    grid = harness.collect(runs)
    figs = dec.figures(grid)
    md = dec.markdown(figs, grid, {"date": "d", "commit": "c", "device": "CPU", "command": "x"}, tmp_path, runs, 60)
    assert "| disc_generated | 2 | 70.00 | — | 0.600 | 25.0 | 402 |" in md
    assert "| fedavg | 1 | 60.00 | — | — | — | 401 |" in md
    assert figs[("disc_generated", "epochs20")]["diag/ens_acc_label_share"] == {0: pytest.approx(90.0)}
    assert figs[("disc_generated", "epochs20")]["round_s"] == {0: 402.0}  # the median: the paused round left out
    assert "the median round: fedavg 402 s, disc_generated 402 s." in md


def test_the_decomposition_pairs_only_runs_one_machine_made(tmp_path):
    """dafkd_decomposition: a seed pairs with FedAvg only when both runs name the same machine (machine.json, which
    the harness writes); another machine's seed is left out and said, a pair with no machine named is refused, and
    FedAvg's 20-step runs are the script's own."""
    dec = importlib.import_module("dafkd_decomposition")
    runs = dec.planned(tmp_path, ["fedavg", "disc_proxy"], ["steps20"], [0, 1, 2])
    assert {r.out.parent for r in runs} == {tmp_path}
    cpus = {("fedavg", 0): "CPU (A)", ("fedavg", 1): "CPU (A)", ("disc_proxy", 0): "CPU (A)",
            ("disc_proxy", 1): "CPU (B)", ("fedavg", 2): "CPU (A)"}
    for r in runs:
        _finished(r.out, r.seed, (0.5, 0.6) if r.method == "fedavg" else (0.5, 0.7))
        if (r.method, r.seed) in cpus:
            harness.record_machine(r.out, "cpu")  # the file as the harness writes it, then its machine set
            (r.out / harness.MACHINE_FILE).write_text(json.dumps({"cpu": cpus[(r.method, r.seed)]}))
    figs = dec.figures(harness.collect(runs))
    pair = dec._paired(figs[("disc_proxy", "steps20")], figs[("fedavg", "steps20")])
    assert pair[2:] == (1, 2) and pair[0] == pytest.approx(5.0)  # last-5 means 60 - 55; seed 0 only: seed 1 other CPU, seed 2 unnamed
    assert dec._fmt(pair) == "+5.00 (n=1) (2 seeds of another CPU left out)"
    only_b = {"acc": {1: 1.0}, "cpu": {1: "CPU (B)"}}
    assert dec._paired(only_b, figs[("fedavg", "steps20")]) == dec.OTHER_CPU
    assert dec._paired({"acc": {2: 1.0}, "cpu": {2: "CPU (A)"}}, figs[("disc_proxy", "steps20")]) == dec.NO_CPU
    assert harness.machine_key(harness.device_name("cpu")).startswith("CPU (")


def test_a_machine_is_named_by_what_sets_its_rounding():
    """machine.json's CPU carries the family, model and stepping and torch's vector width beside the name: two AMD
    EPYC machines (AVX2, AVX-512) share the name and not the rounding."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "cpu family" in cpuinfo.read_text():
        import torch

        key = harness.machine_key(harness.device_name("cpu"))
        assert " family " in key and key.endswith(f"; {torch.backends.cpu.get_cpu_capability()})"), key


def test_dafkd_fmnist_pairs_only_runs_one_machine_made():
    """dafkd_fmnist: each method minus FedAvg and DaFKD minus its ablations pair only the seeds one machine made (the
    decomposition's rule, harness.paired_by_seed); a run naming no machine refuses its pairs; a difference within one
    run (FedFTG's fine-tuning against its average) pairs whatever made it."""
    fm = importlib.import_module("dafkd_fmnist")
    assert importlib.import_module("dafkd_decomposition")._fmt is harness.fmt_paired  # one copy of the pairing

    def recs(method, accs, cpus, avg=None):
        return [{"method": method, "alpha": 0.1, "seed": s, "accuracy": a, "accuracy_last5": a, "cpu": c,
                 **({"accuracy_avg_last5": avg[s]} if avg else {})} for s, (a, c) in enumerate(zip(accs, cpus))]

    by = {("fedavg", 0.1): recs("fedavg", (0.5, 0.5, 0.5), ("CPU (A)", "CPU (A)", None)),
          ("dafkd", 0.1): recs("dafkd", (0.6, 0.7, 0.6), ("CPU (A)", "CPU (B)", "CPU (A)")),
          ("dafkd_no_correlation", 0.1): recs("dafkd_no_correlation", (0.4, 0.4, 0.4), (None, None, None)),
          ("dafkd_no_sharing", 0.1): recs("dafkd_no_sharing", (0.4, 0.4, 0.4), ("CPU (B)", "CPU (A)", "CPU (B)")),
          ("fedftg", 0.1): recs("fedftg", (0.6, 0.6, 0.6), (None, None, None), avg=(0.5, 0.5, 0.5))}
    pair = fm._vs(by, "dafkd", "fedavg", 0.1)
    assert pair[0] == pytest.approx(10.0) and pair[2:] == (1, 2)  # seed 0 only: seed 1 another CPU, seed 2 unnamed
    assert harness.fmt_paired(pair) == "+10.00 (n=1) (2 seeds of another CPU left out)"
    assert fm._vs(by, "dafkd", "dafkd_no_correlation", 0.1) == harness.NO_CPU
    assert fm._vs(by, "dafkd", "dafkd_no_sharing", 0.1) == harness.OTHER_CPU
    md = "\n".join(fm.orderings(by, [0.1]) + fm.baseline_mechanisms(by, [0.1]))
    assert "| 0.1 | dafkd | +10.00 (n=1) (2 seeds of another CPU left out) | +2.84 | 1 seed: no reading |" in md
    assert "| 0.1 | dafkd_no_correlation | — (CPU not recorded) | +6.46 | no reading |" in md
    assert "| 0.1 | dafkd_no_sharing | — (other CPU) | +0.30 | no reading |" in md
    assert "fine-tuning minus the average it starts from, last 5 rounds: +10.00 ± 0.00 points" in md


def test_compression_configs_validate_and_the_table_reads_budgets_and_ratios(tmp_path):
    """compression_fmnist: every method is a valid config, FedAvg, FedKF and FedCD system_fmnist's own, each other one
    its base with the channel its name says; the accuracy at a budget is the last evaluated round within it, and the
    ratio of MB to a target is a compressed FedAvg's over FedCD's."""
    comp, sysb = importlib.import_module("compression_fmnist"), importlib.import_module("system_fmnist")

    def dump(module, method):
        d = module.make_config(method, "alpha0.1", 0, 30, "cpu").model_dump(mode="json")
        return {k: v for k, v in d.items() if k != "name"}

    cfgs = {m: dump(comp, m) for m in comp.METHODS}
    for m in ("fedavg", "fedkf", "fedcd"):
        assert cfgs[m] == dump(sysb, m)
    changed = {m: {k: v for k, v in cfgs[m]["channel"].items() if cfgs["fedavg"]["channel"][k] != v} for m in cfgs}
    assert changed["fedavg_q8"] == changed["fedcd_q8"] == {"quantize": "qsgd"}  # 8 bits, uploads: the defaults
    assert cfgs["fedavg_q8"]["channel"]["bits"] == 8 and cfgs["fedavg_q8"]["channel"]["compress_on"] == "up"
    assert changed["fedavg_q8_both"] == {"quantize": "qsgd", "compress_on": "both"}
    assert changed["fedavg_top1_ef"] == {"sparsify": "topk", "error_feedback": True}
    assert cfgs["fedavg_top1_ef"]["channel"]["fraction"] == 0.01
    assert {k: v for k, v in cfgs["fedcd_q8"].items() if k != "channel"} == \
        {k: v for k, v in cfgs["fedcd"].items() if k != "channel"}

    hist = [{"round": 1, "eval/accuracy": 0.2, "comm/bytes_up": 4e6, "comm/bytes_down": 4e6},
            {"round": 2, "comm/bytes_up": 1e6, "comm/bytes_down": 1e6},  # not evaluated
            {"round": 3, "eval/accuracy": 0.35, "comm/bytes_up": 5e5, "comm/bytes_down": 5e5}]
    assert comp.accuracy_within(hist, 10.0) == (1, 0.2)  # round 2 within 10 MB, not evaluated
    assert comp.accuracy_within(hist, 11.0) == (3, 0.35)
    assert comp.accuracy_within(hist, 7.0) == (None, None)
    runs = harness.plan(tmp_path, ["fedavg_q8", "fedcd"], ["alpha0.1"], [0])
    for r, scale in zip(runs, (1.0, 0.1)):
        _finished(r.out, 0)
        rows = [{**h, "comm/bytes_up": h["comm/bytes_up"] * scale, "comm/bytes_down": h["comm/bytes_down"] * scale}
                for h in hist]
        pq.write_table(pa.Table.from_pylist(rows), r.out / "history.parquet")
        (r.out / "summary.json").write_text(json.dumps({"eval/accuracy": 0.35, "comm/bytes_up": 5.5e6 * scale,
                                                        "comm/bytes_down": 5.5e6 * scale, "comm/bytes_setup": 9e6}))
    res = comp.collect(harness.collect(runs))
    md = comp.tables(res, {}, tmp_path, runs)
    assert "| fedcd | personal | 1 | 35.00 ± 0.00 |" in md and "| fedavg_q8 | global | 1 |" in md
    assert "| 3.0 | 11.0 |" in md  # fedavg_q8 reaches 30 % at round 3, after 11 MB
    assert "- 30%, MB over fedcd's: fedavg —; fedavg_q8 10.0x (1.09x with setup);" in md  # 11 / 1.1, 11 / (1.1 + 9)



def test_every_adversaries_cell_validates_or_is_a_documented_refusal():
    """adversaries_fmnist: every cell of its grid is a checked config of the method's preset at alpha 0.5 with 20 %
    malicious clients; every cell of methods x attacks x rules left out is a refusal the script documents: a robust
    rule refused by a method that declares no robust means, or an attack that finds nothing to forge in the method's
    upload (refused at the first malicious upload)."""
    from fedray.errors import ConfigError, RunFailure
    from fedray.simulation import run_experiment
    from tests.conftest import method_config

    adv = importlib.import_module("adversaries_fmnist")
    cells = adv.grid()
    assert {m: len(s) for m, s in cells.items()} == {"fedavg": 16, "fedkf": 12, "fedcd": 3, "fedcd_uniform": 12,
                                                     "feddf": 16}
    assert [r.out.name for r in adv.planned(REPO / "x", ["fedavg", "fedcd"], ["sign_flip-krum", "forge_logits-mean"],
                                            [0, 1])] == [
        "fedavg_sign_flip-krum_seed0", "fedcd_forge_logits-mean_seed0", "fedavg_sign_flip-krum_seed1",
        "fedcd_forge_logits-mean_seed1"]  # seed by seed; a cell outside a method's grid is never planned
    assert {m: adv.rules_of(m) for m in adv.METHODS} == {
        "fedavg": adv.RULES, "fedkf": adv.RULES[:3], "fedcd": ("mean",), "fedcd_uniform": adv.RULES,
        "feddf": adv.RULES}
    for m in adv.METHODS:
        for rule in adv.RULES[1:]:
            if rule not in adv.rules_of(m):  # the rule is refused before any work, whatever the attack
                with pytest.raises(ConfigError) as e:
                    adv.make_config(m, adv.setting_name("none", rule), 0, 30)
                assert e.value.key.startswith("aggregation."), e.value
        for attack in adv.ATTACKS:
            in_grid = [adv.setting_name(attack, r) in cells[m] for r in adv.RULES]
            if (m, attack) in adv.REFUSED_ATTACKS:
                assert not any(in_grid)
                continue
            assert in_grid == [True] * len(adv.rules_of(m)) + [False] * (len(adv.RULES) - len(adv.rules_of(m)))
            for rule in adv.rules_of(m):
                cfg = adv.make_config(m, adv.setting_name(attack, rule), 0, 30)
                n = cfg.federation.clients_per_round
                assert (cfg.adversary.attack, cfg.data.alpha, cfg.aggregation.rule, cfg.federation.rounds) == \
                    (attack, 0.5, rule, 30)
                assert cfg.adversary.fraction == (0.2 if attack != "none" else 0.0)
                if rule == "krum":  # f: the malicious expected in a round, rounded up, within 2f + 2 < n
                    assert cfg.aggregation.f == math.ceil(0.2 * n) == 2 and 2 * cfg.aggregation.f + 2 < n
                if rule == "trimmed_mean":  # f / n of each end, at least the malicious share
                    assert cfg.aggregation.beta == math.ceil(0.2 * n) / n >= 0.2
    assert adv.make_config("fedavg", "sign_flip-mean", 0, 30).adversary.scale == 3.0
    assert adv.make_config("fedcd", "none-mean", 0, 30).model.client_models is None

    # the attacks left out: refused in one line at the first malicious upload
    tiny = {"federation__rounds": 1, "federation__local_steps": 1, "adversary__clients": [0, 1, 2, 3]}
    lenet = {"model__client_models": None}
    for (m, attack), why in adv.REFUSED_ATTACKS.items():
        assert why
        if m == "fedcd_uniform":
            continue  # fedcd's uploads: the teacher the server builds from them does not change what a client sends
        over = {**tiny, **(lenet if m == "fedcd" else {}), "adversary__attack": attack}
        with pytest.raises(RunFailure, match=f"^adversary.attack={attack}: "):
            run_experiment(method_config(m, **over), progress=False)


def _adv_run(out: Path, seed: int, accuracy: float, attack_success: float | None = None, cpu: str = "CPU (A)") -> None:
    """An adversaries_fmnist run folder: 5 evaluated rounds at ``accuracy``, one malicious upload a round."""
    _finished(out, seed)
    rows = [{"round": i + 1, "eval/accuracy": accuracy, "adv/malicious_uploads": 1.0,
             **({"eval/attack_success": attack_success} if attack_success is not None else {})} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), out / "history.parquet")
    (out / harness.MACHINE_FILE).write_text(json.dumps({"cpu": cpu}))


def test_the_adversaries_record_reads_its_cells_and_the_two_readings(tmp_path, capsys):
    """adversaries_fmnist from fabricated runs: each cell's accuracy and its paired losses, "—" where a cell has not
    run or has no attack-success figure; FedDF losing 20 points fewer than FedAvg under the sign flip resists
    better; the median, 28 points above the mean under it, helps FedAvg, and the trimmed mean, cutting the backdoor's
    success, helps against it; the methods without robust rules are said to have no defence; --report-only rebuilds
    the record byte for byte."""
    adv = importlib.import_module("adversaries_fmnist")
    runs = tmp_path / "runs"
    figures = {("fedavg", "none-mean"): (0.80, 0.81, 0.79), ("fedavg", "sign_flip-mean"): (0.50, 0.52, 0.48),
               ("fedavg", "sign_flip-median"): (0.78, 0.79, 0.77), ("fedavg", "none-median"): (0.79, 0.80, 0.78),
               ("feddf", "none-mean"): (0.80, 0.80, 0.80), ("feddf", "sign_flip-mean"): (0.70, 0.71, 0.69)}
    for (m, s), accs in figures.items():
        for seed, a in enumerate(accs):
            _adv_run(runs / harness.run_name(m, s, seed), seed, a)
    for seed, (mean_asr, trimmed_asr) in enumerate(((0.90, 0.20), (0.92, 0.21), (0.88, 0.19))):
        _adv_run(runs / harness.run_name("fedavg", "backdoor-mean", seed), seed, 0.78, attack_success=mean_asr)
        _adv_run(runs / harness.run_name("fedavg", "backdoor-trimmed_mean", seed), seed, 0.78,
                 attack_success=trimmed_asr)
    _adv_run(runs / harness.run_name("fedavg", "backdoor-median", 0), 0, 0.77, cpu="CPU (B)")
    args = ["--report-only", "--out", str(tmp_path), "--runs-dir", str(runs)]
    adv.main(args)
    md = (tmp_path / "adversaries_fmnist.md").read_text()
    record = json.loads((tmp_path / "adversaries_fmnist.json").read_text())
    capsys.readouterr()
    assert "| sign_flip | mean | 3 | 50.00 ± 2.00 | -30.00 ± 0.58 |  | — | 1.00 |  |" in md
    assert "| sign_flip | median | 3 | 78.00 ± 1.00 | -1.00 ± 0.00 | +28.00 ± 0.58 | — | 1.00 |  |" in md
    assert "| backdoor | mean | 3 | 78.00 ± 0.00 | -2.00 ± 0.58 |  | 90.00 ± 2.00 | 1.00 |  |" in md
    other = harness.OTHER_CPU  # its one seed ran on another CPU than the seeds it would pair with
    assert f"| backdoor | median | 1 | 77.00 ± 0.00 | {other} | {other} | — | 1.00 |  |" in md
    assert "| lie | krum | 0 | — | — | — | — | — | — |" in md  # not run: its row stays, empty
    assert "| feddf | sign_flip | -10.00 ± 0.58 | -30.00 ± 0.58 | +20.00 ± 0.82 | resists better |  |  |" in md
    assert "- feddf against FedAvg, accuracy lost: resists better: sign_flip." in md
    assert "- fedkf against FedAvg: no reading yet" in md
    assert "  - sign_flip: median +28.00 ± 0.58; trimmed_mean —; krum —. Helps most: median; helps: median." in md
    assert "- fedavg, cost without an attack: median -1.00 ± 0.00; trimmed_mean —; krum —." in md
    # the trimmed mean leaves the accuracy as it is and the trigger's success 70 points lower: it helps
    assert (f"  - backdoor: median {other} (attack success —); trimmed_mean +0.00 ± 0.00 (attack success -70.00 ± "
            "0.58); krum — (attack success —). Helps most: trimmed_mean; helps: trimmed_mean.") in md
    assert "  - lie: median —; trimmed_mean —; krum —. No reading yet." in md
    for m in ("fedcd",):  # Eq. 4: only the mean; the others take rules
        assert f"- {m}: no defence available: it takes only the mean (median, trimmed_mean, krum refused: Eq. 4" in md
    assert "- fedcd under lie: FedCD uploads logits" in md
    assert record["grid"] == adv.grid() and len(record["runs"]["fedavg|none-mean"]) == 3
    adv.main(args)  # the record rebuilt from the run folders alone
    capsys.readouterr()
    assert (tmp_path / "adversaries_fmnist.md").read_text() == md
    assert json.loads((tmp_path / "adversaries_fmnist.json").read_text()) == record


def _failing_build(run, opts):
    import tests.runtime.faulty  # noqa: F401  (registers test_nan_everyone: every upload non-finite in round 2)
    from tests.conftest import tiny_config

    return tiny_config(algorithm__name="test_nan_everyone", federation__rounds=3, tracking__enabled=False)


def test_a_run_that_stops_is_an_outcome_where_the_benchmark_says_so(tmp_path):
    """failures_are_results: the RunFailure is written to failed.json (the run is not pending any more); otherwise it
    propagates as before."""
    import harness

    from fedray.errors import RunFailure

    run = harness.Run("m", "s", 0, tmp_path / "m_s_seed0")
    with pytest.raises(RunFailure, match="every upload was non-finite"):
        harness.run_one(_failing_build, run, {})
    assert run.failure is None and harness.pending([run]) == [run]
    out = harness.run_one(_failing_build, run, {"failures_are_results": True})
    assert out.startswith("failed m_s_seed0: round 2: every upload was non-finite")
    assert run.failure.startswith("round 2: every upload") and harness.pending([run]) == []


def test_the_million_clients_record_is_its_json_read_against_the_targets():
    """benchmarks/results/million.md is what --report-only writes from million.json (no figure typed in by hand),
    and each (data, system, runtime) row's verdict follows from its cells."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("million", REPO / "benchmarks" / "speed" / "million.py")
    million = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "benchmarks" / "speed"))  # its system_scale import
    try:
        spec.loader.exec_module(million)
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "speed"))
    record = json.loads((RESULTS / "million.json").read_text())
    assert million.markdown(record) == (RESULTS / "million.md").read_text()
    assert {c["clients"] for c in record["cells"]} == {10_000, 100_000, 1_000_000} and len(record["cells"]) == 24
    local = [c["result"] for c in record["cells"] if c["runtime"] == "local"]
    assert all(r["derivations"] == 100 + 1000 * (len(r["round_s"])) for r in local)


def test_mutmut_runs_a_mutants_tests_killers_first_then_fastest_first_keeping_each_module_together():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ordered", REPO / "benchmarks/quality/mutmut_ordered.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # mutmut itself only when run
    duration = {"tests/a.py::slow": 9.0, "tests/a.py::fast": 0.5, "tests/b.py::x": 0.1, "tests/b.py::y": 3.0,
                "tests/c.py::only": 1.0}
    tests = {"tests/a.py::slow", "tests/a.py::fast", "tests/b.py::y", "tests/b.py::x", "tests/c.py::only",
             "tests/c.py::new"}
    # modules by their fastest test (b: 0.1 s, a: 0.5 s, c: 1.0 s), each one's tests by duration, an unrecorded one last
    assert module.fastest_first(tests, duration) == ["tests/b.py::x", "tests/b.py::y", "tests/a.py::fast",
                                                     "tests/a.py::slow", "tests/c.py::only", "tests/c.py::new"]
    # a sibling mutant's killers first, the latest first, once each; one this mutant's tests do not hold is left out
    killers = ["tests/a.py::slow", "tests/c.py::new", "tests/gone.py::t", "tests/a.py::slow"]
    assert module.fastest_first(tests, duration, killers) == ["tests/a.py::slow", "tests/c.py::new", "tests/b.py::x",
                                                              "tests/b.py::y", "tests/a.py::fast", "tests/c.py::only"]
    assert module.function_of("fedray.runtime.core.x_build_method__mutmut_7") == "fedray.runtime.core.x_build_method"
