"""The fixed reader (fedray.reader): trained once per dataset and cached, frozen, a fair judge of real images, and
the diag/reader_* figures of a DaFKD run that asks for them."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from fedray import reader as reader_module
from fedray.data import build_federated_data
from fedray.data.federated import to_float
from fedray.simulation import run_experiment
from tests.conftest import LEARNABLE, tiny_config
from tests.methods.test_dafkd import dafkd_config

QUICK = 80  # Adam steps: enough for the synthetic class templates, seconds on a CPU


@pytest.fixture
def quick_reader(monkeypatch, tmp_path):
    """The reader's budget cut for tests (the cache key follows it), cached in a folder of the test's own."""
    monkeypatch.setattr(reader_module, "STEPS", QUICK)
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _learnable_data():
    cfg = tiny_config(**{k.replace(".", "__"): v for k, v in LEARNABLE.items() if k.startswith("data.")})
    return build_federated_data(cfg.data, cfg.seed)


def test_the_reader_is_trained_once_cached_and_reads_the_test_set_at_its_accuracy(quick_reader, monkeypatch):
    data = _learnable_data()
    first = reader_module.load_reader(data, torch.device("cpu"))
    cached = list(quick_reader.glob("reader-*.pt"))
    assert len(cached) == 1
    assert first.test_accuracy > 0.5  # ten classes: well above chance
    x = to_float(torch.from_numpy(np.array(data.test_x)), data.mean, data.std)
    scores = first.read(x, torch.from_numpy(np.array(data.test_y)))
    assert scores["diag/reader_agreement"] == pytest.approx(first.test_accuracy)  # the real images' labels
    assert scores["diag/reader_fid"] == pytest.approx(0.0, abs=1e-6)  # the test set against itself
    assert scores["diag/reader_test_acc"] == first.test_accuracy

    def never(*_):
        raise AssertionError("trained again although cached")

    monkeypatch.setattr(reader_module, "train_reader", never)
    again = reader_module.load_reader(data, torch.device("cpu"))
    for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    monkeypatch.setattr(reader_module, "STEPS", QUICK + 1)  # another budget: another entry
    with pytest.raises(AssertionError, match="trained again"):
        reader_module.load_reader(data, torch.device("cpu"))


def test_class_entropy_and_frechet_distance_by_hand(quick_reader):
    data = _learnable_data()
    r = reader_module.load_reader(data, torch.device("cpu"))
    x = to_float(torch.from_numpy(np.array(data.test_x)), data.mean, data.std)
    y = torch.from_numpy(np.array(data.test_y))
    one_class = x[y == 3][:40]
    assert r.read(one_class, None)["diag/reader_class_entropy"] < r.read(x, None)["diag/reader_class_entropy"]
    assert "diag/reader_agreement" not in r.read(x, None)  # nothing was asked for
    # two Gaussians with diagonal covariances: ||mu_1 - mu_2||^2 + sum (s1 + s2 - 2 sqrt(s1 s2))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(200_000, 2, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 2.0])
    mean, cov = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.diag(torch.tensor([4.0, 1.0], dtype=torch.float64))
    expected = 1.0 + (1 + 4 - 2 * 2) + (4 + 1 - 2 * 2)
    assert reader_module.frechet_distance(a, mean, cov) == pytest.approx(expected, abs=0.05)


def test_a_dafkd_run_scores_its_generated_samples_and_never_changes_the_reader(quick_reader):
    on = dafkd_config(algorithm__generator="conditional", algorithm__diag_reader=True, algorithm__diag_samples=0)
    result = run_experiment(on, progress=False)
    (cached,) = quick_reader.glob("reader-*.pt")
    before = hashlib.sha256(cached.read_bytes()).hexdigest()
    keys = ("diag/reader_agreement", "diag/reader_class_entropy", "diag/reader_fid", "diag/reader_test_acc")
    for row in result.history:
        assert all(math.isfinite(row[k]) for k in keys), row
        assert 0 <= row["diag/reader_agreement"] <= 1 and 0 <= row["diag/reader_class_entropy"] <= 1
    assert not any(p.requires_grad for p in reader_module.load_reader(
        build_federated_data(on.data, on.seed), torch.device("cpu")).model.parameters())  # frozen
    run_experiment(on, progress=False)  # a second run reads the cached reader and leaves it as it was
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == before
    off = run_experiment(dafkd_config(algorithm__generator="conditional", algorithm__diag_samples=0),
                         progress=False).history
    strip = lambda h: [{k: v for k, v in r.items() if not k.startswith(("time/", "diag/"))} for r in h]  # noqa: E731
    assert strip(result.history) == strip(off)  # the reader never feeds back into the method
    assert not any(k.startswith("diag/reader") for row in off for k in row)
