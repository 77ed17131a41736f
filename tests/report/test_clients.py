"""clients.parquet (every evaluated client at every evaluation) and ``fedray report --clients RUN``.

The expected figures come from the run's own history.parquet and model.pt, and from hand-written files."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fedray.cli import main
from fedray.data import build_federated_data
from fedray.data.federated import to_float
from fedray.models import build_model
from fedray.record.run_dir import (CLIENT_HISTORY_FILE, CLIENT_PARTS_DIR, ClientHistory, clear_previous_run,
                                   read_history)
from fedray.simulation import run_experiment
from tests.conftest import method_config, tiny_config
from tests.test_every_method import CrashAfter, _Crash

# run name -> config: a global model evaluated every round; one evaluated every second round (and the last); a
# personalised method (each client's own model) with a validation set, every second round
RUNS = {
    "fedavg": dict(federation__rounds=3),
    "fedavg-every2": dict(federation__rounds=5, federation__eval_every=2),
    "local": dict(algorithm__name="local", model__client_models=["lenet5", "mlp"], federation__rounds=3,
                  federation__eval_every=2, data__val_per_class=5),
}
EVALUATED = {"fedavg": [1, 2, 3], "fedavg-every2": [2, 4, 5], "local": [2, 3]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("client-runs")
    out = {}
    for name, overrides in RUNS.items():
        cfg = tiny_config(**overrides)
        result = run_experiment(cfg, root / name, progress=False)
        out[name] = (root / name, result, build_federated_data(cfg.data, cfg.seed))
    return out


def _table(folder) -> pa.Table:
    return pq.read_table(folder / CLIENT_HISTORY_FILE)


@pytest.mark.parametrize("name", RUNS)
def test_one_row_per_evaluated_client_and_evaluated_round(runs, name):
    folder, result, data = runs[name]
    table = _table(folder)
    assert table.schema.field("round").type == pa.int64() and table.schema.field("client").type == pa.int64()
    rows = list(zip(table["round"].to_pylist(), table["client"].to_pylist()))
    # in round order, then client order; nothing twice, nothing from a round that was not evaluated
    assert rows == [(r, c) for r in EVALUATED[name] for c in range(data.num_clients)]
    assert [row["round"] for row in result.history if row["eval/accuracy"] is not None] == EVALUATED[name]
    sizes = [len(t) for t in data.client_test]
    assert table["samples"].to_pylist() == sizes * len(EVALUATED[name])
    personal = {"global_accuracy", "val_accuracy"}
    assert personal <= set(table.column_names) if name == "local" else not personal & set(table.column_names)
    assert not (folder / CLIENT_PARTS_DIR).exists()  # the parts are gone once the file is written


@pytest.mark.parametrize("name", RUNS)
def test_amp_fm_wlp_of_every_evaluation_are_recomputed_from_the_clients_rows(runs, name):
    folder, result, _ = runs[name]
    clients = _table(folder).to_pandas()
    for row in read_history(folder):
        if row["eval/accuracy"] is None:
            continue
        mine = clients[clients["round"] == row["round"]]
        acc = mine["accuracy"].to_numpy()
        assert (acc == mine["correct"] / mine["samples"]).all()
        assert row["eval/amp"] == mine["correct"].sum() / mine["samples"].sum()  # FedKF Def. 1
        assert row["eval/fm"] == np.var(acc)  # Def. 2: the population variance
        assert row["eval/wlp"] == acc.min()  # Def. 3
        if name == "local":  # each client's own model on the global test set and the validation set
            assert row["eval/accuracy"] == pytest.approx(mine["global_accuracy"].mean(), rel=1e-12)
            assert row["val/accuracy"] == pytest.approx(mine["val_accuracy"].mean(), rel=1e-12)


@pytest.mark.parametrize("name", ["fedavg", "local"])
def test_the_last_rows_are_the_final_models_accuracy_and_mean_cross_entropy(runs, name):
    """Each client's last row, against model.pt scored on its test split one image at a time."""
    folder, result, data = runs[name]
    weights = torch.load(folder / "model.pt", weights_only=True)
    last = _table(folder).to_pandas().query(f"round == {EVALUATED[name][-1]}").set_index("client")
    cfg = tiny_config(**RUNS[name])
    checked = 0
    for cid, idx in enumerate(data.client_test):
        own = weights.get(cid) if name == "local" else weights
        if own is None:  # a client that never trained: its initial model, not in model.pt
            continue
        model = build_model(cfg.model.client_architecture(cid), data.input_shape, data.num_classes)
        model.load_state_dict(own)
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(to_float(torch.from_numpy(data.train_x[i : i + 1]), data.mean, data.std))
                                for i in idx])
        y = torch.from_numpy(data.train_y[idx]).long()
        assert last.loc[cid, "accuracy"] == (logits.argmax(1) == y).double().mean().item()
        assert last.loc[cid, "loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
        checked += 1
    assert checked >= 3


def test_a_resumed_run_writes_the_uninterrupted_runs_file(tmp_path):
    """Killed after round 3 with the checkpoint of round 2: no clients.parquet, the parts of rounds 1-3 on disk;
    resumed, the round-3 part is dropped and redone, and the file is the uninterrupted run's, row for row."""
    cfg = tiny_config(federation__rounds=4, runtime__checkpoint_every=2)
    run_experiment(cfg, tmp_path / "whole", progress=False)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(3)])
    assert not (tmp_path / "run" / CLIENT_HISTORY_FILE).exists()  # a killed run never shows a file
    parts = tmp_path / "run" / CLIENT_PARTS_DIR
    assert sorted(p.name for p in parts.iterdir()) == [f"round-{r:08d}.parquet" for r in (1, 2, 3)]
    # were round 3's part kept (appended to) rather than redone, the file would differ from the uninterrupted one
    pq.write_table(pq.read_table(parts / "round-00000003.parquet").slice(0, 2), parts / "round-00000003.parquet")
    run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run")
    assert _table(tmp_path / "run").equals(_table(tmp_path / "whole"))
    assert not parts.exists()


def test_a_resume_drops_the_parts_after_its_checkpoint_and_keeps_the_rest(tmp_path):
    history = ClientHistory(tmp_path)
    for r in (1, 2, 3, 4):
        history.add(r, {"client": np.array([0, 1]), "accuracy": np.array([0.5, 1.0])})
    ClientHistory(tmp_path, resume_round=2)
    assert sorted(p.name for p in (tmp_path / CLIENT_PARTS_DIR).iterdir()) == ["round-00000001.parquet",
                                                                                "round-00000002.parquet"]
    ClientHistory(tmp_path)  # a new run in the folder: nothing of the earlier one
    assert not (tmp_path / CLIENT_PARTS_DIR).exists()


def test_a_run_stopped_without_a_checkpoint_leaves_no_parts(tmp_path):
    """Nothing could resume them: the folder is left as the run would leave it without per-client history."""
    with pytest.raises(_Crash):
        run_experiment(tiny_config(federation__rounds=3, runtime__checkpoint_every=0), tmp_path / "run",
                       progress=False, hooks=[CrashAfter(2)])
    assert not (tmp_path / "run").exists()  # found empty, left empty: removed (results.claim_run_dir)


def test_a_run_resumed_from_a_checkpoint_without_parts_writes_no_partial_file(tmp_path, caplog):
    """A checkpoint of a fedray that did not record per-client figures: the rounds before it cannot be
    recovered, so no clients.parquet (which would read as complete), with a warning; the run finishes."""
    cfg = tiny_config(federation__rounds=3, runtime__checkpoint_every=1)
    with pytest.raises(_Crash):
        run_experiment(cfg, tmp_path / "run", progress=False, hooks=[CrashAfter(2)])
    shutil.rmtree(tmp_path / "run" / CLIENT_PARTS_DIR)
    run_experiment(cfg, tmp_path / "run", progress=False, resume_from=tmp_path / "run")
    assert (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / CLIENT_HISTORY_FILE).exists()
    assert "clients.parquet not written" in caplog.text and "round(s) 1, 2" in caplog.text


@pytest.mark.parametrize("method", ["fedavg", "local"])
def test_clients_without_a_test_split_are_not_written(method, tmp_path):
    """Evaluated clients are those with a local test split (all of them, as the data is built). With 20
    registered clients of which only 4 keep test samples, only those 4 have rows, and FM / WLP over them are
    the run's."""
    cfg = method_config(method, data__num_clients=20, federation__rounds=2)
    data = build_federated_data(cfg.data, cfg.seed)
    keep = {3, 7, 8, 15}
    empty = np.zeros(0, np.int64)
    data = dataclasses.replace(
        data, client_train=[tr if k in keep else np.sort(np.concatenate([tr, te]))
                            for k, (tr, te) in enumerate(zip(data.client_train, data.client_test))],
        client_test=[te if k in keep else empty for k, te in enumerate(data.client_test)])
    result = run_experiment(cfg, tmp_path / "run", progress=False, data=data)
    table = _table(tmp_path / "run").to_pandas()
    assert table["client"].tolist() == sorted(keep) * 2 and table["round"].tolist() == [1] * 4 + [2] * 4
    last = table[table["round"] == 2]
    assert result.summary["eval/fm"] == np.var(last["accuracy"].to_numpy())
    assert result.summary["eval/wlp"] == last["accuracy"].min()


def test_a_new_run_removes_an_earlier_runs_client_history(tmp_path):
    for name in (CLIENT_HISTORY_FILE, "clients.png"):
        (tmp_path / name).write_text("from an earlier run")
    (tmp_path / CLIENT_PARTS_DIR).mkdir()
    (tmp_path / CLIENT_PARTS_DIR / "round-00000009.parquet").write_text("from an earlier run")
    removed = clear_previous_run(tmp_path)
    assert set(removed) == {CLIENT_HISTORY_FILE, "clients.png", CLIENT_PARTS_DIR}
    assert list(tmp_path.iterdir()) == []


# --- fedray report --clients ----------------------------------------------------------------------------------


def _write(path, rounds: dict[int, list[float]]):
    """A clients.parquet with the given accuracies per round (client ids 0.., 10 test samples each)."""
    cols = {"round": [], "client": [], "accuracy": [], "loss": [], "correct": [], "samples": []}
    for r, accs in rounds.items():
        for c, a in enumerate(accs):
            for k, v in (("round", r), ("client", c), ("accuracy", a), ("loss", 1.0), ("correct", round(10 * a)),
                         ("samples", 10)):
                cols[k].append(v)
    pq.write_table(pa.table(cols), path)


def test_round_spreads_by_hand(tmp_path, monkeypatch):
    from fedray.report import clients

    _write(tmp_path / CLIENT_HISTORY_FILE, {2: [0.5, 0.2, 0.9, 0.2, 0.7], 4: [0.6, 0.8, 0.3, 0.9, 0.4]})
    s2, s4 = clients.round_spreads(tmp_path / CLIENT_HISTORY_FILE)
    assert (s2.round, s2.clients, s2.worst, s2.worst_client, s2.best, s2.best_client) == (2, 5, 0.2, 1, 0.9, 2)
    assert (s2.q25, s2.median, s2.q75) == pytest.approx((0.2, 0.5, 0.7))  # sorted 0.2 0.2 0.5 0.7 0.9
    assert s2.fm == pytest.approx(np.var([0.5, 0.2, 0.9, 0.2, 0.7])) and s2.amp == pytest.approx(25 / 50)
    assert (s4.worst, s4.worst_client, s4.median) == (0.3, 2, pytest.approx(0.6))
    assert clients.most_often_worst([s2, s4]) == (1, 1)  # once each: the lower id
    # read a few rows at a time, a round's rows split over batches: the same figures
    monkeypatch.setattr(clients, "BATCH_ROWS", 3)
    assert clients.round_spreads(tmp_path / CLIENT_HISTORY_FILE) == [s2, s4]


def test_the_table_shows_every_round_or_evenly_spaced_ones_first_and_last_kept():
    from fedray.report.clients import RoundSpread, shown_rounds

    spreads = [RoundSpread(r, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0) for r in range(1, 31)]
    assert [s.round for s in shown_rounds(spreads[:12])] == list(range(1, 13))
    shown = [s.round for s in shown_rounds(spreads, most=5)]
    assert shown == [1, 8, 15, 23, 30]  # positions 0, 7.25, 14.5, 21.75, 29 rounded (half to even)


def test_report_clients_prints_the_spread_and_plots_it(runs, capsys, tmp_path):
    folder, result, _ = runs["fedavg-every2"]
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    assert main(["report", "--clients", str(copy)]) == 0
    out = capsys.readouterr().out
    last = _table(copy).to_pandas().query("round == 5")
    worst = int(last.sort_values(["accuracy", "client"]).iloc[0]["client"])
    row = [line for line in out.splitlines() if line.startswith("│") and line.split("│")[1].strip() == "5"]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].split("│")[1:-1]]
    assert cells[:4] == ["5", "6", f"{100 * result.summary['eval/wlp']:.2f}", str(worst)]
    assert cells[-2:] == [f"{1e3 * result.summary['eval/fm']:.3f}", f"{100 * result.summary['eval/amp']:.2f}"]
    assert f"client spread plotted to {copy / 'clients.png'}" in out
    assert (copy / "clients.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", "--clients", str(copy), "--plot", str(tmp_path / "spread.png")]) == 0
    assert (tmp_path / "spread.png").is_file() and f"plotted to {tmp_path / 'spread.png'}" in capsys.readouterr().out


def _error(capsys, *argv) -> str:
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --clients: ")
    return err


def test_report_clients_refuses_bad_input_in_one_line(runs, capsys, tmp_path):
    assert "does not exist" in _error(capsys, "--clients", str(tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    assert "not a directory" in _error(capsys, "--clients", str(tmp_path / "file"))
    old = tmp_path / "old"  # a finished run from before clients.parquet
    shutil.copytree(runs["fedavg"][0], old)
    (old / CLIENT_HISTORY_FILE).unlink()
    assert "run it again" in _error(capsys, "--clients", str(old))
    (old / "summary.json").unlink()
    (old / "checkpoint.pt").write_text("")
    assert f"fedray run --resume {old}" in _error(capsys, "--clients", str(old))
    assert "RUNS" in _error(capsys, str(runs["fedavg"][0]), "--clients", str(runs["fedavg"][0]))
    assert not list(tmp_path.glob("**/clients.png"))
