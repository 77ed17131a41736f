"""What a training or aggregating process claims of its machine, and gives back."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from threadpoolctl import threadpool_info

from fedray.runtime.process import claim_process
from tests.conftest import tiny_config


def _blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


def test_a_claimed_process_runs_blas_on_one_thread_and_gives_back_what_it_had():
    suite_threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not the claim's 1 (tests/conftest.py may have set 1): the give-back must show
    try:
        before_blas, before_env = _blas_threads(), os.environ.get("OPENBLAS_NUM_THREADS")
        give_back = claim_process(tiny_config(runtime__num_cpus_per_worker=1))
        try:
            assert torch.get_num_threads() == 1 and _blas_threads() == {1}
            assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
        finally:
            give_back()
        assert torch.get_num_threads() == 3 and _blas_threads() == before_blas
        assert os.environ.get("OPENBLAS_NUM_THREADS") == before_env
    finally:
        torch.set_num_threads(suite_threads)


def test_a_blas_library_loaded_after_the_claim_runs_on_one_thread_too():
    """scipy's own OpenBLAS loads with scipy.linalg (FedCD's server imports it on its first round), after the claim."""
    code = ("from fedray.runtime.process import claim_process; from tests.conftest import tiny_config; "
            "import sys; assert 'scipy.linalg' not in sys.modules; claim_process(tiny_config()); import scipy.linalg; "
            "from threadpoolctl import threadpool_info; "
            "print(sorted({(l['filepath'], l['num_threads']) for l in threadpool_info() if l['user_api'] == 'blas'}))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    libraries = eval(out)  # noqa: S307 (our own subprocess's list of (path, threads))
    assert any("scipy" in path and "numpy" not in path for path, _ in libraries), libraries
    assert {threads for _, threads in libraries} == {1}, libraries
