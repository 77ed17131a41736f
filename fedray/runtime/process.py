"""What a process that trains or aggregates for a run claims of its machine, and gives back: its threads and malloc."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from threadpoolctl import threadpool_limits

from fedray.config import ExperimentConfig
from fedray.runtime.malloc import keep_freed_memory

#: BLAS libraries read these when they load (scipy's own OpenBLAS loads with scipy.linalg, after the claim)
_BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def torch_threads(cfg: ExperimentConfig) -> int:
    """Threads per worker = its CPU share, so workers on one node don't fight over cores."""
    return max(1, int(cfg.runtime.num_cpus_per_worker))


def claim_process(cfg: ExperimentConfig) -> Callable[[], None]:
    """A process that trains or aggregates for ``cfg`` (an actor, the driver holding the server, the in-process
    runtime): torch's threads set to the worker's CPU share, numpy's and scipy's BLAS to one thread, and glibc's
    malloc tuned (``runtime.malloc_tuning``).

    One BLAS thread in every process: fedray's numpy work is small (FedCD's Eq. 4 solver, the partitions), and a
    BLAS reduction split over another number of threads rounds differently, so a server in a Ray actor (where Ray
    sets one thread) would give other last bits than the same server in the driver (this machine's cores).
    Returns the function that gives the process back: torch's and BLAS's threads, and the variables, as they were.
    """
    before = torch.get_num_threads()
    variables = {name: os.environ.get(name) for name in _BLAS_THREAD_VARIABLES}
    os.environ.update({name: "1" for name in _BLAS_THREAD_VARIABLES})  # for the BLAS libraries loaded later
    # those loaded already; first, as its restore puts back every library's threads, torch's OpenMP ones too
    blas = threadpool_limits(limits=1, user_api="blas")
    torch.set_num_threads(torch_threads(cfg))
    keep_freed_memory(cfg.runtime.malloc_tuning)

    def give_back() -> None:
        blas.restore_original_limits()
        torch.set_num_threads(before)
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return give_back
