"""Seeds derived from (run seed, purpose, round, client id): every random draw in fedray comes from here.

Deriving instead of sharing one generator keeps draws independent of execution order, so the local and
the Ray runtime (and a resumed run) make identical draws.
"""

from __future__ import annotations

import zlib

import numpy as np


def _part(p: int | str) -> int:
    # crc32 is stable across processes and Python versions, unlike hash().
    return zlib.crc32(p.encode()) if isinstance(p, str) else int(p) & 0xFFFFFFFF


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed for ``parts`` (e.g. ``"client", round, client_id``) under the run ``seed``."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *(_part(p) for p in parts)])
    return int(ss.generate_state(2, dtype=np.uint32).astype(np.uint64) @ np.array([1 << 31, 1], np.uint64))


def derive_rng(seed: int, *parts: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *parts))


def sample_clients(seed: int, round_: int, num_clients: int, per_round: int) -> list[int]:
    """The clients active in ``round_``, in client-id order (results are aggregated in this order)."""
    rng = derive_rng(seed, "sample", round_)
    return sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False))
