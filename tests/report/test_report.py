"""fedray.report: the comparison table from run directories and from MLflow, markdown, plot, user errors.

The expected numbers are recomputed here from each run's own summary.json / history.parquet.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pandas as pd
import pytest

from fedray.load import load_config
from fedray.errors import UserError
from fedray.report import (
    RunRecord,
    build_table,
    load_mlflow_runs,
    load_run_dirs,
    parse_value,
    plot_curves,
    report,
    to_markdown,
)
from fedray.report.table import footnote
from fedray.simulation import run_experiment
from tests.conftest import tiny_config

# run dir (relative to the root) -> tiny_config overrides
RUNS = {
    "fedavg/s1": dict(seed=1),
    "fedavg/s2": dict(seed=2),
    "fedprox/mu0.1-s1": dict(seed=1, algorithm__name="fedprox", algorithm__mu=0.1),
    "fedprox/mu0.1-s2": dict(seed=2, algorithm__name="fedprox", algorithm__mu=0.1),
    "fedprox/mu0.01-s1": dict(seed=1, algorithm__name="fedprox", algorithm__mu=0.01),
    # another setting, evaluated only in rounds 2 and 3
    "alpha0.5/fedavg-s1": dict(seed=1, data__alpha=0.5, federation__rounds=3, federation__eval_every=2),
}
# (method, setting) -> run dirs of that row, in the table's order (setting, then method)
ROWS = [
    ("fedavg", "synthetic α=0.5", ["alpha0.5/fedavg-s1"]),
    ("fedavg", "synthetic α=1", ["fedavg/s1", "fedavg/s2"]),
    ("fedprox mu=0.01", "synthetic α=1", ["fedprox/mu0.01-s1"]),
    ("fedprox mu=0.1", "synthetic α=1", ["fedprox/mu0.1-s1", "fedprox/mu0.1-s2"]),
]
METRICS = [("eval/accuracy", "accuracy (%)", 100, 2), ("eval/amp", "AMP (%)", 100, 2),
           ("eval/fm", "FM (×10⁻³)", 1e3, 3), ("eval/wlp", "WLP (%)", 100, 2)]


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for rel, overrides in RUNS.items():
        run_experiment(tiny_config(**overrides), root / rel, progress=False)
    # an unfinished run: a config but no summary.json
    (root / "fedavg" / "crashed").mkdir()
    (root / "fedavg" / "crashed" / "config.yaml").write_text((root / "fedavg/s1/config.yaml").read_text())
    return root


def _summary(root: Path, rel: str) -> dict:
    return json.loads((root / rel / "summary.json").read_text())


def _history(root: Path, rel: str) -> pd.DataFrame:
    return pd.read_parquet(root / rel / "history.parquet")


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _first_round(root: Path, rel: str, target: float) -> int | None:
    df = _history(root, rel)
    hit = df[df["eval/accuracy"].notna() & (df["eval/accuracy"] >= target)]
    return int(hit["round"].min()) if len(hit) else None


def _pick_target(root: Path) -> float:
    # the higher of the two fedavg seeds' best accuracies: reached by one seed, usually not by both
    return max(float(_history(root, rel)["eval/accuracy"].max()) for rel in ("fedavg/s1", "fedavg/s2"))


def _expected_row(root: Path, method: str, setting: str, rels: list[str], target: float) -> dict:
    summaries = [_summary(root, r) for r in rels]
    row = {"method": method, "setting": setting, "seeds": str(len(rels))}
    for key, header, scale, dec in METRICS:
        mean, std = _mean_std([s[key] * scale for s in summaries])
        row[header] = f"{mean:.{dec}f} ± {std:.{dec}f}"
    last = [_history(root, r)["eval/accuracy"].dropna().tail(5).mean() * 100 for r in rels]
    row["last 5 (%)"] = "{:.2f} ± {:.2f}".format(*_mean_std(last))
    hits = [_first_round(root, r, target) for r in rels]
    reached = [h for h in hits if h is not None]
    if not reached:
        cell = "—" if len(rels) == 1 else f"— (0/{len(rels)} reached)"
    else:
        m = statistics.fmean(reached)
        cell = f"{m:.0f}" if m.is_integer() else f"{m:.1f}"
        if len(reached) < len(rels):
            cell += f" ({len(reached)}/{len(rels)} reached)"
    row[f"rounds to {target * 100:g}%"] = cell
    to_target = [float((_history(root, r).query("round <= @h")[["comm/bytes_up", "comm/bytes_down"]]).sum().sum())
                 for r, h in zip(rels, hits) if h is not None]
    row[f"MB to {target * 100:g}%"] = f"{statistics.fmean(to_target) / 1e6:,.2f}" if to_target else "—"
    row["MB up"] = f"{statistics.fmean(s['comm/bytes_up'] for s in summaries) / 1e6:,.2f}"
    row["MB down"] = f"{statistics.fmean(s['comm/bytes_down'] for s in summaries) / 1e6:,.2f}"
    return row


def _display(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


# --------------------------------------------------------------------------------------------------
# run directories


def test_table_from_run_dirs_matches_hand_computed(run_root, capsys):
    runs = load_run_dirs([run_root])
    assert "crashed" in capsys.readouterr().err  # unfinished run skipped with a warning
    assert sorted(r.name for r in runs) == sorted(Path(rel).name for rel in RUNS)
    target = _pick_target(run_root)
    rows = build_table(runs, target=target)
    expected = [_expected_row(run_root, m, s, rels, target) for m, s, rels in ROWS]
    assert _display(rows) == expected

    # the raw numbers behind the strings: per-seed fractions and byte totals
    fedavg = rows[1]
    s1, s2 = _summary(run_root, "fedavg/s1"), _summary(run_root, "fedavg/s2")
    assert sorted(fedavg["_stats"]["eval/accuracy"]) == sorted([s1["eval/accuracy"], s2["eval/accuracy"]])
    assert sorted(fedavg["_stats"]["comm/bytes_up"]) == sorted([s1["comm/bytes_up"], s2["comm/bytes_up"]])
    assert sorted(fedavg["_stats"]["rounds_to_target"], key=str) == sorted(
        [_first_round(run_root, "fedavg/s1", target), _first_round(run_root, "fedavg/s2", target)], key=str)


def test_single_run_dir_and_typed_params(run_root):
    (run,) = load_run_dirs([run_root / "fedprox/mu0.1-s2"])
    assert run.params["algorithm.mu"] == 0.1 and run.params["seed"] == 2
    assert run.params["data.alpha"] == 1.0 and run.params["federation.rounds"] == 2
    assert [row["round"] for row in run.history] == [1, 2]
    (run,) = load_run_dirs([run_root / "alpha0.5/fedavg-s1" / "summary.json"])
    assert run.history[0]["eval/accuracy"] is None  # round 1 not evaluated


def test_run_dir_layout_and_readers(run_root):
    from fedray.record.checkpoint import FILENAME as CHECKPOINT_FILE
    from fedray.record.run_dir import RESULT_FILES, is_finished, read_history, read_summary

    run = run_root / "fedavg/s1"
    # no temp file, no per-client part left; the last round's checkpoint stays (the run may be extended)
    assert sorted(p.name for p in run.iterdir()) == sorted([*RESULT_FILES, CHECKPOINT_FILE])
    assert is_finished(run) and not is_finished(run_root / "fedavg/crashed")
    assert read_summary(run) == _summary(run_root, "fedavg/s1")
    history = read_history(run)
    assert history == read_history(run / "history.parquet")
    assert [row["round"] for row in history] == _history(run_root, "fedavg/s1")["round"].tolist()


def test_method_label_adds_differing_algorithm_params_and_fills_defaults():
    def rec(name, seed, **params):
        p = {"data.dataset": "synthetic", "data.alpha": 0.1, "seed": seed, **params}
        return RunRecord(name, p, [], {"eval/accuracy": 0.5})

    runs = [
        rec("a", 1, **{"algorithm.name": "fedprox"}),  # default mu (0.01) filled in by the loader only
        rec("b", 1, **{"algorithm.name": "fedprox", "algorithm.mu": 0.1}),
        rec("c", 1, **{"algorithm.name": "fedavg"}),
    ]
    labels = [r["method"] for r in build_table(runs)]
    assert labels == ["fedavg", "fedprox mu=0.1", "fedprox mu=—"]  # missing sorts last
    # through the loader's defaults the implicit mu shows as its value
    from fedray.report import fill_algorithm_defaults

    runs[0].params = fill_algorithm_defaults(dict(runs[0].params))
    assert [r["method"] for r in build_table(runs)] == ["fedavg", "fedprox mu=0.01", "fedprox mu=0.1"]


def test_setting_labels_spell_values_as_a_config_does():
    def rec(name, vectorize):
        p = {"data.dataset": "synthetic", "algorithm.name": "fedavg", "runtime.vectorize": vectorize, "seed": 0}
        return RunRecord(name, p, [], {"eval/accuracy": 0.5})

    rows = build_table([rec("a", True), rec("b", "auto"), rec("c", False)], by_setting=("runtime.vectorize",))
    assert sorted(r["setting"] for r in rows) == ["vectorize=auto", "vectorize=false", "vectorize=true"]


def test_rounds_to_target_partial_and_std_of_one_seed():
    def rec(seed, accs):
        hist = [{"round": i + 1, "eval/accuracy": a} for i, a in enumerate(accs)]
        last = [a for a in accs if a is not None][-1]
        return RunRecord(f"s{seed}", {"algorithm.name": "fedavg", "data.dataset": "mnist", "data.alpha": 0.1,
                                      "seed": seed}, hist, {"eval/accuracy": last})

    two = [rec(1, [0.1, None, 0.5, 0.7]), rec(2, [0.2, 0.3, 0.4, 0.45])]
    (row,) = build_table(two, target=0.5)
    assert row["rounds to 50%"] == "3 (1/2 reached)"
    assert row["accuracy (%)"] == f"57.50 ± {statistics.stdev([70, 45]):.2f}"
    last = [statistics.fmean([10, 50, 70]), statistics.fmean([20, 30, 40, 45])]  # unevaluated rounds skipped
    assert row["last 5 (%)"] == f"{statistics.fmean(last):.2f} ± {statistics.stdev(last):.2f}"
    assert row["AMP (%)"] == "—"  # not recorded by these runs
    (row,) = build_table(two, target=60)  # a percentage is read as 60 %
    assert row["rounds to 60%"] == "4 (1/2 reached)"
    (row,) = build_table(two, target=0.9)
    assert row["rounds to 90%"] == "— (0/2 reached)"
    (row,) = build_table([rec(1, [0.1, 0.2, 0.6, 0.7, 0.8, 0.9])], target=0.65)  # only the last 5 count
    assert row["rounds to 65%"] == "4" and row["accuracy (%)"] == "90.00 ± 0.00" and row["last 5 (%)"] == "64.00 ± 0.00"


def test_megabytes_to_reach_the_target_and_setup_bytes():
    def rec(seed, accs, up, down, setup=None):
        hist = [{"round": i + 1, "eval/accuracy": a, "comm/bytes_up": up, "comm/bytes_down": down}
                for i, a in enumerate(accs)]
        summary = {"eval/accuracy": accs[-1], **({"comm/bytes_setup": setup} if setup else {})}
        return RunRecord(f"s{seed}", {"algorithm.name": "fedcd" if setup else "fedavg", "data.dataset": "mnist",
                                      "data.alpha": 0.5, "seed": seed}, hist, summary)

    runs = [rec(0, [0.2, 0.6, 0.7], 1e6, 2e6, setup=5e6), rec(1, [0.6, 0.7, 0.8], 1e6, 2e6, setup=5e6),
            rec(2, [0.1, 0.2, 0.3], 4e6, 4e6)]
    rows = {r["method"]: r for r in build_table(runs, target=0.6)}
    assert rows["fedcd"]["MB to 60%"] == "4.50"  # seed 0: 2 rounds x 3 MB; seed 1: 1 round x 3 MB
    assert rows["fedcd"]["MB setup"] == "5.00" and "MB setup" not in rows["fedavg"]
    assert rows["fedavg"]["MB to 60%"] == "—"  # never reached
    table = to_markdown(list(rows.values()))
    assert "| MB setup |" in table and table.count("\n| fed") == 2


def test_runs_with_a_validation_set_get_its_column():
    def rec(seed, method, val=None):
        summary = {"eval/accuracy": 0.5, **({"val/accuracy": val} if val is not None else {})}
        return RunRecord(f"s{seed}", {"algorithm.name": method, "data.dataset": "mnist", "data.alpha": 0.1,
                                      "seed": seed}, [], summary)

    rows = {r["method"]: r for r in build_table([rec(0, "fedavg", 0.4), rec(1, "fedavg", 0.6), rec(0, "fedprox")])}
    assert rows["fedavg"]["val (%)"] == f"50.00 ± {statistics.stdev([40, 60]):.2f}"
    assert "val (%)" not in rows["fedprox"] and "| val (%) |" in to_markdown(list(rows.values()))
    assert "validation set" in footnote(list(rows.values()))
    assert "val (%)" not in build_table([rec(0, "fedprox")])[0]


def test_final_figures_choose_a_round_by_validation_without_the_test_set():
    from fedray.record.run_dir import final_figures

    rows = [{"round": r, "eval/accuracy": test, "val/accuracy": val}
            for r, test, val in ((1, 0.3, 0.5), (2, 0.8, 0.6), (4, 0.4, 0.7), (5, 0.5, 0.7))]
    got = final_figures(rows)
    assert got["eval/accuracy"] == 0.5 and got["val/accuracy"] == 0.7 and got["eval/best_accuracy"] == 0.8
    assert got["eval/accuracy_at_best_val"] == 0.4 and got["val/best_round"] == 4  # the earliest of equals
    plain = final_figures([{k: v for k, v in r.items() if k != "val/accuracy"} for r in rows])
    assert "eval/accuracy_at_best_val" not in plain and plain["eval/best_accuracy"] == 0.8
    assert final_figures([]) == {}


def test_pool_of_different_configs_warns(capsys):
    def rec(seed, rounds):
        return RunRecord(f"s{seed}", {"algorithm.name": "fedavg", "data.dataset": "mnist", "data.alpha": 0.1,
                                      "seed": seed, "federation.rounds": rounds}, [], {"eval/accuracy": 0.5})

    build_table([rec(1, 10), rec(2, 20), rec(2, 10)])
    err = capsys.readouterr().err
    assert "federation.rounds" in err and "seed 2" in err


def test_markdown_shape(run_root):
    rows = build_table(load_run_dirs([run_root]), target=0.5)
    text = to_markdown(rows)
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["method", "setting", "seeds", "accuracy (%)", "last 5 (%)", "AMP (%)", "FM (×10⁻³)", "WLP (%)",
                      "rounds to 50%", "MB to 50%", "MB up", "MB down"]
    assert [c.strip() for c in lines[1].strip("|").split("|")] == [":---", ":---"] + ["---:"] * 10
    table = lines[2 : 2 + len(rows)]
    assert all(line.startswith("| ") and line.count(" | ") == len(header) - 1 for line in table)
    assert table[1].startswith("| fedavg | synthetic α=1 | 2 | ")
    assert lines[2 + len(rows)] == ""  # the footnote is a separate paragraph
    assert "sample std (ddof=1)" in lines[3 + len(rows)] and "0 for a single seed" in lines[3 + len(rows)]


def test_plot_curves_writes_png(run_root, tmp_path):
    runs = load_run_dirs([run_root])
    out = plot_curves(runs, tmp_path / "sub" / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    out = plot_curves(runs, tmp_path / "fm.png", metric="eval/fm")
    assert out.stat().st_size > 0
    with pytest.raises(UserError):
        plot_curves(runs, tmp_path / "none.png", metric="eval/nothing")


def test_learning_curves_against_the_megabytes_communicated():
    from fedray.report.curves import mean_megabytes
    from fedray.report.runs import RunRecord

    def run(up):  # rounds 1-3, each sending ``up`` bytes up and 1e6 down; round 2 evaluated only
        return RunRecord("r", {}, [{"round": r, "comm/bytes_up": up, "comm/bytes_down": 1e6} for r in (1, 2, 3)])

    # until the end of round 2: 2 x (up + 1 MB), mean over the runs
    assert mean_megabytes([run(1e6), run(3e6)], [2, 3]) == [pytest.approx(6.0), pytest.approx(9.0)]


def test_report_command_says_where_the_curves_went(run_root, tmp_path, capsys):
    from fedray.cli import main

    png = tmp_path / "curves.png"
    assert main(["report", str(run_root), "--plot", str(png)]) == 0
    assert f"learning curves written to {png}" in capsys.readouterr().out and png.stat().st_size > 5000


def test_report_writes_markdown_and_plot(run_root, tmp_path):
    text = report([str(run_root)], None, None, ("algorithm.name",), ("data.dataset", "data.alpha"), 0.3,
                  str(tmp_path / "out" / "table.md"), str(tmp_path / "curves.png"))
    assert (tmp_path / "out" / "table.md").read_text() == text
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # grouping by method only pools the two alphas of fedavg (and warns that they differ)
    text = report([str(run_root / "fedavg"), str(run_root / "alpha0.5")], None, None, ("algorithm.name",), (),
                  None, None, None)
    assert "| fedavg | all | 3 |" in text


def test_user_errors(tmp_path, run_root, capsys):
    with pytest.raises(UserError) as e:
        load_run_dirs([tmp_path / "nope"])
    assert e.value.key == "RUNS" and "does not exist" in e.value.message
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        report([str(tmp_path / "empty")], None, None, ("algorithm.name",), (), None, None, None)
    assert e.value.key == "RUNS" and "no finished runs" in e.value.message
    with pytest.raises(UserError) as e:
        report([str(run_root / "fedavg" / "crashed")], None, None, ("algorithm.name",), (), None, None, None)
    assert e.value.key == "RUNS" and "summary.json" in capsys.readouterr().err
    with pytest.raises(UserError) as e:
        report([], None, None, ("algorithm.name",), (), None, None, None)
    assert e.value.key == "RUNS"
    with pytest.raises(UserError) as e:
        build_table([])
    assert e.value.key == "RUNS"
    # a key no run has (a typo) is refused, not made a group "key=—" of every run
    for by_method, by_setting, option in [(("algorithm.nmae",), ("data.alpha",), "--by-method"),
                                          (("algorithm.name",), ("data.alhpa",), "--by-setting")]:
        with pytest.raises(UserError) as e:
            report([str(run_root)], None, None, by_method, by_setting, None, None, None)
        assert e.value.key == option and e.value.message.startswith(by_method[0] if option == "--by-method"
                                                                      else by_setting[0])


def test_parse_value():
    assert parse_value("0.1") == 0.1 and parse_value("3") == 3 and parse_value("1e-05") == 1e-5
    assert parse_value("True") is True and parse_value("false") is False and parse_value("None") is None
    assert parse_value("fashion_mnist") == "fashion_mnist" and parse_value("1.0") == 1.0
    assert isinstance(parse_value("1.0"), float) and isinstance(parse_value("3"), int)


# --------------------------------------------------------------------------------------------------
# MLflow


def _log_run(client, exp_id: str, run_dir: Path, kind: str = "run", status: str = "FINISHED",
             parent: str | None = None) -> str:
    """Log a finished run dir the way fedray's tracking contract says: flat params, history at step=round."""
    from mlflow.entities import Metric, Param

    cfg = load_config(str(run_dir / "config.yaml"))
    tags = {"fedray.kind": kind, "fedray.algorithm": cfg.algorithm.name, "fedray.dataset": cfg.data.dataset}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run_id = client.create_run(exp_id, tags=tags, run_name=run_dir.name).info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in cfg.flat().items()])
    ts = int(time.time() * 1000)
    for row in pd.read_parquet(run_dir / "history.parquet").to_dict("records"):
        metrics = [Metric(k, float(v), ts, int(row["round"])) for k, v in row.items()
                   if k != "round" and v is not None and not math.isnan(v)]
        client.log_batch(run_id, metrics=metrics)
    client.set_terminated(run_id, status=status)
    return run_id


@pytest.fixture(scope="module")
def mlflow_store(run_root, tmp_path_factory):
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    base = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{(base / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("cmp", artifact_location=(base / "artifacts").resolve().as_uri())
    client.create_experiment("other", artifact_location=(base / "artifacts2").resolve().as_uri())
    # a sweep parent holding a tempting figure; it must not become a row or change one
    sweep = client.create_run(exp_id, tags={"fedray.kind": "sweep", "fedray.algorithm": "fedavg",
                                            "fedray.dataset": "synthetic"}, run_name="sweep").info.run_id
    client.log_batch(sweep, params=[Param("algorithm.name", "fedavg"), Param("data.dataset", "synthetic"),
                                    Param("data.alpha", "1.0"), Param("seed", "9")],
                     metrics=[Metric("eval/accuracy", 0.99, 0, 2)])
    for i, rel in enumerate(RUNS):
        _log_run(client, exp_id, run_root / rel, kind="trial" if i % 2 else "run", parent=sweep if i % 2 else None)
    client.set_terminated(sweep)
    # a failed run is not a finished run
    _log_run(client, exp_id, run_root / "fedavg/s1", status="FAILED")
    return uri


def test_table_from_mlflow_equals_run_dirs(run_root, mlflow_store, capsys):
    target = _pick_target(run_root)
    runs = load_mlflow_runs("cmp", mlflow_store)
    assert "FAILED" in capsys.readouterr().err
    assert sorted(r.name for r in runs) == sorted(Path(rel).name for rel in RUNS)
    from_mlflow = build_table(runs, target=target)
    from_dirs = build_table(load_run_dirs([run_root]), target=target)
    assert _display(from_mlflow) == _display(from_dirs)
    assert _display(from_mlflow) == [_expected_row(run_root, m, s, rels, target) for m, s, rels in ROWS]
    for a, b in zip(from_mlflow, from_dirs):
        for key in ("eval/accuracy", "eval/fm", "comm/bytes_up", "comm/bytes_down"):
            assert sorted(a["_stats"][key]) == pytest.approx(sorted(b["_stats"][key]))
    (run,) = [r for r in runs if r.name == "fedavg-s1"]
    assert run.params["data.alpha"] == 0.5 and run.params["federation.eval_every"] == 2
    assert run.params["data.data_dir"] is None and isinstance(run.params["tracking.enabled"], bool)
    # MLflow's string params come back typed as in config.yaml
    by_name = {r.name: r for r in load_run_dirs([run_root])}
    for r in runs:
        assert r.params == by_name[r.name].params
    assert [row["round"] for row in run.history] == [1, 2, 3] and run.history[0]["eval/accuracy"] is None


def test_mlflow_default_uri_from_env_and_errors(mlflow_store, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    assert len(load_mlflow_runs("cmp", None)) == len(RUNS)
    with pytest.raises(UserError) as e:
        load_mlflow_runs("nope", None)
    assert e.value.key == "--experiment" and "cmp" in e.value.message and "other" in e.value.message
    # default store: ./mlflow.db, which must not be created when it is missing
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        report([], "cmp", None, ("algorithm.name",), ("data.dataset",), None, None, None)
    assert e.value.key == "--experiment" and str(tmp_path / "mlflow.db") in e.value.message
    assert not (tmp_path / "mlflow.db").exists()


def test_a_run_given_twice_counts_once(run_root, mlflow_store, tmp_path):
    """A run dir under two given paths, or given as a dir and as its MLflow run, would pass for two seeds."""
    import shutil

    root = tmp_path / "runs"
    shutil.copytree(run_root, root)
    for run in load_mlflow_runs("cmp", mlflow_store):  # what a tracked run leaves beside its results
        (rel,) = [r for r in RUNS if Path(r).name == run.name]
        (root / rel / "mlflow_run.json").write_text(json.dumps({"tracking_uri": mlflow_store, "run_id": run.run_id}))
    keys = (("algorithm.name", "algorithm.mu"), ("data.dataset", "data.alpha"))
    once = report([str(root)], None, None, *keys, None, None, None)
    assert report([str(root), str(root / "fedavg/s1"), str(root / "fedavg")], "cmp", mlflow_store, *keys,
                  None, None, None) == once
    assert report([str(root / "fedavg/s1")], "cmp", mlflow_store, *keys, None, None, None) == once


def test_simulated_hours_to_reach_the_target_and_their_curve(tmp_path):
    """Runs with a simulated system get ``sim h to X%`` (the clock at the round that first reaches the target, mean
    over the seeds that do) and a third row of panels against the simulated hours; runs without get neither."""
    from fedray.report.curves import mean_sim_hours

    def rec(seed, accs, clock=None, method="fedavg"):
        hist = [{"round": i + 1, "eval/accuracy": a, "comm/bytes_up": 1.0, "comm/bytes_down": 1.0,
                 **({"sim/clock_s": clock[i]} if clock else {})} for i, a in enumerate(accs)]
        return RunRecord(f"s{seed}", {"algorithm.name": method, "data.dataset": "mnist", "data.alpha": 0.1,
                                      "seed": seed}, hist, {"eval/accuracy": accs[-1]})

    timed = [rec(0, [0.2, 0.6, 0.7], [1800, 3600, 7200]), rec(1, [0.6, 0.7, 0.8], [900, 5400, 9000]),
             rec(2, [0.1, 0.2, 0.3], [3600, 7200, 10800])]
    (row,) = build_table(timed, target=0.6)
    assert row["sim h to 60%"] == "0.625"  # seed 0 at round 2: 1 h; seed 1 at round 1: 0.25 h; seed 2 never
    from fedray.report.table import hours_text

    assert [hours_text(56 / 3600), hours_text(87 / 3600), hours_text(1234.5)] == ["0.0156", "0.0242", "1,234.50"]
    assert row["rounds to 60%"] == "1.5 (2/3 reached)"
    assert "simulated clock" in footnote([row])
    (plain,) = build_table([rec(0, [0.2, 0.6, 0.7])], target=0.6)
    assert "sim h to 60%" not in plain and "simulated clock" not in footnote([plain])
    assert mean_sim_hours(timed, [1, 3]) == pytest.approx([(0.5 + 0.25 + 1) / 3, (2 + 2.5 + 3) / 3])
    assert mean_sim_hours([rec(0, [0.2])], [1]) is None
    small = plot_curves([rec(0, [0.2, 0.6, 0.7])], tmp_path / "plain.png")
    big = plot_curves(timed, tmp_path / "timed.png")
    from PIL import Image

    assert Image.open(big).size[1] > Image.open(small).size[1]  # a third row of panels


def test_an_attacked_private_runs_row_shows_attack_success_the_malicious_clients_and_epsilon_by_hand():
    from fedray.report.runs import RunRecord
    from fedray.report.table import build_table, footnote

    params = {"algorithm.name": "fedavg", "data.dataset": "synthetic", "data.alpha": 0.5}
    runs = [RunRecord(f"s{seed}", {**params, "seed": seed},
                      history=[{"round": 1, "eval/accuracy": 0.5, "eval/attack_success": 0.2,
                                "adv/malicious_uploads": 1.0, "adv/malicious_kept": 0.0},
                               {"round": 2, "eval/accuracy": 0.6, "eval/attack_success": succ,
                                "adv/malicious_uploads": ups, "adv/malicious_kept": 1.0}],
                      summary={"eval/accuracy": 0.6})
            for seed, succ, ups in ((1, 0.3, 2.0), (2, 0.5, 0.0))]
    runs[0].history[-1]["privacy/epsilon"], runs[1].summary["privacy/epsilon"] = 3.0, 5.0  # a private run's
    (row,) = build_table(runs)
    assert row["ε"] == "4.00 ± 1.41" and "dp-accounting" in footnote([row])
    assert row["attack success (%)"] == "40.00 ± 14.14"  # the last round's 30 % and 50 %
    assert row["malicious a round"] == "1.00" and row["malicious kept a round"] == "0.50"  # (1.5 + 0.5) / 2
    assert "attack success" in footnote([row]) and "Krum kept" in footnote([row])
    (plain,) = build_table([RunRecord("p", {**params, "seed": 1}, history=[{"round": 1, "eval/accuracy": 0.5}],
                                      summary={"eval/accuracy": 0.5})])
    assert "attack success (%)" not in plain and "malicious a round" not in plain and "ε" not in plain
