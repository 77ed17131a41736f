"""Fixtures for the data tests: an isolated environment (the real Fashion-MNIST fixture is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from fedray.data.cache import CACHE_DIR_ENV
from fedray.data.datasets import DATA_DIR_ENV, DEBIAN_FASHION_MNIST_ENV

@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """No Debian copy, a throwaway default root and decoded cache, so a test sees only the files it writes."""
    monkeypatch.setenv(DEBIAN_FASHION_MNIST_ENV, str(tmp_path / "no-debian-here"))
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "default-root"))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "decoded-cache"))
    return tmp_path
