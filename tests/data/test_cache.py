"""The decoded-dataset cache (fedray.data.cache): hits give the decoded arrays, stale or damaged entries are
rebuilt, an unwritable folder only warns."""

import logging

import pytest

from fedray.config import DataConfig
from fedray.data.cache import CACHE_DIR_ENV
from fedray.data.loading import load_dataset
from tests.data.test_datasets import write_mnist_like


def _cfg(env, **kw) -> DataConfig:
    return DataConfig(data_dir=str(env / "root"), dataset="mnist", download=False, **kw)


def _entries(env):
    return sorted(p.name for p in (env / "cache" / "mnist").glob("*") if not p.name.startswith("."))


def _same(a, b):
    for k in ("train_x", "train_y", "test_x", "test_y"):
        x, y = getattr(a, k), getattr(b, k)
        assert x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous and (x == y).all()
    assert (a.num_classes, a.mean, a.std) == (b.num_classes, b.mean, b.std)


@pytest.fixture
def env(isolated_env, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(isolated_env / "cache"))
    write_mnist_like(isolated_env / "root" / "MNIST" / "raw")
    return isolated_env


def test_a_hit_gives_the_decoded_arrays_memory_mapped_without_torchvision(env, monkeypatch):
    first = load_dataset(_cfg(env), 0)
    assert len(_entries(env)) == 5  # four .npy and the metadata
    import fedray.data.datasets as ds

    monkeypatch.setattr(ds, "_decode_torchvision", lambda *a: pytest.fail("decoded again on a hit"))
    again = load_dataset(_cfg(env), 0)
    _same(again, first)
    assert not again.train_x.flags.writeable  # the cache file's pages, read-only


def test_changed_source_files_rebuild_the_entry_and_drop_the_stale_one(env):
    load_dataset(_cfg(env), 0)
    before = _entries(env)
    write_mnist_like(env / "root" / "MNIST" / "raw", n_train=30)  # new size and mtime
    raw = load_dataset(_cfg(env), 0)
    assert raw.train_x.shape[0] == 30
    after = _entries(env)
    assert len(after) == 5 and not set(after) & set(before)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "meta", "missing"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(env, damage, caplog):
    good = load_dataset(_cfg(env), 0)
    folder = env / "cache" / "mnist"
    npy = next(folder.glob("*.train_x.npy"))
    if damage == "truncate":
        npy.write_bytes(npy.read_bytes()[:200])
    elif damage == "garbage":
        npy.write_bytes(b"not a numpy file")
    elif damage == "meta":
        next(folder.glob("*.json")).write_text("{")
    else:
        npy.unlink()
    with caplog.at_level(logging.WARNING, logger="fedray"):
        raw = load_dataset(_cfg(env), 0)
    _same(raw, good)
    assert "damaged" in caplog.text and "rebuilding" in caplog.text
    caplog.clear()
    _same(load_dataset(_cfg(env), 0), good)  # rebuilt: a clean hit
    assert "damaged" not in caplog.text


def test_an_unwritable_cache_folder_warns_and_the_run_goes_on(env, caplog):
    blocker = env / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="fedray"):
        raw = load_dataset(_cfg(env, cache_dir=str(blocker)), 0)
    assert raw.train_x.shape == (20, 1, 28, 28)
    assert "cannot write the decoded-dataset cache" in caplog.text and "data.cache_dir" in caplog.text


def test_cache_off_and_cache_dir(env):
    load_dataset(_cfg(env, cache=False), 0)
    assert not (env / "cache").exists()
    load_dataset(_cfg(env, cache_dir=str(env / "mine")), 0)
    assert len(list((env / "mine" / "mnist").glob("*.npy"))) == 4


def test_concurrent_writers_leave_one_complete_entry(env):
    """Two processes decoding and writing the same entry at once (two runs, or a sweep's trials): each file
    is renamed into place whole, so the survivor is complete and loads as a hit."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=load_dataset, args=(_cfg(env), 0)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    assert len(_entries(env)) == 5 and not [p for p in (env / "cache" / "mnist").iterdir() if p.name.endswith(".part")]
    load_dataset(_cfg(env), 0)
