"""Per-client state beyond a bound kept on disk (``runtime.client_state_memory``, ``runtime.client_state_dir``): the
in-process runtime's client states and channel states (SCAFFOLD's control variates, FedCD's personal models, DaFKD's
heads, error-feedback residuals) and a server's per-client state (the slots of FedKF's cache,
:mod:`fedray.learning.cached`, in process and in a server actor alike) as a mapping that holds at most ``bound`` of
them in memory, the least recently used of the others written to a folder, one file a client, and read back when the
client is next asked for, as pfl-research keeps its clients' state in a store. What it returns is what it was given
(``torch.save`` / ``torch.load`` of the state, tensors bit for bit); a checkpoint takes every state
(:meth:`ClientStore.as_dict`; a store inside a server state pickles as all its states, and unpickles as a store of
the same bound), so a resumed run has them all whichever were on disk. On Ray the client states are objects in Ray's
object store, which spills them to disk itself beyond its memory."""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch


class ClientStore(MutableMapping):
    """Client id -> state, at most ``bound`` of them in memory (the most recently used), the others in ``folder``
    (a temporary folder of its own when None, removed with the store)."""

    def __init__(self, bound: int, folder: str | Path | None = None):
        if bound < 1:
            raise ValueError("a client store keeps at least one state in memory")
        self.bound = bound
        self._own = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="fedray-clients-")) if folder is None else Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._memory: OrderedDict[int, Any] = OrderedDict()
        self._on_disk: set[int] = set()
        self.writes = 0  # states written to disk (evictions)

    def _path(self, cid: int) -> Path:
        return self.folder / f"{cid}.pt"

    def __getitem__(self, cid: int) -> Any:
        if cid in self._memory:
            self._memory.move_to_end(cid)
            return self._memory[cid]
        if cid not in self._on_disk:
            raise KeyError(cid)
        state = torch.load(self._path(cid), weights_only=False)
        self._on_disk.discard(cid)
        self._path(cid).unlink()
        self._keep(cid, state)
        return state

    def __setitem__(self, cid: int, state: Any) -> None:
        if cid in self._on_disk:
            self._on_disk.discard(cid)
            self._path(cid).unlink()
        self._keep(cid, state)

    def _keep(self, cid: int, state: Any) -> None:
        self._memory[cid] = state
        self._memory.move_to_end(cid)
        while len(self._memory) > self.bound:
            old, value = self._memory.popitem(last=False)
            torch.save(value, self._path(old))
            self._on_disk.add(old)
            self.writes += 1

    def __delitem__(self, cid: int) -> None:
        if cid in self._memory:
            del self._memory[cid]
        elif cid in self._on_disk:
            self._on_disk.discard(cid)
            self._path(cid).unlink()
        else:
            raise KeyError(cid)

    def __contains__(self, cid: object) -> bool:
        return cid in self._memory or cid in self._on_disk

    def __iter__(self) -> Iterator[int]:
        return iter(sorted([*self._memory, *self._on_disk]))

    def __len__(self) -> int:
        return len(self._memory) + len(self._on_disk)

    def in_memory(self) -> int:
        return len(self._memory)

    def as_dict(self) -> dict[int, Any]:
        """Every state, read from disk where it is (a checkpoint's copy); the store itself is left as it was."""
        out = dict(self._memory)
        for cid in self._on_disk:
            out[cid] = torch.load(self._path(cid), weights_only=False)
        return dict(sorted(out.items()))

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)

    def kept_folder(self) -> str | None:
        """The folder it was given (None: a temporary one of its own)."""
        return None if self._own else str(self.folder)

    @classmethod
    def holding(cls, bound: int, folder: str | Path | None, states: dict[int, Any]) -> "ClientStore":
        store = cls(bound, folder)
        for cid, state in states.items():
            store[cid] = state
        return store

    def __reduce__(self):
        # a server state holding a store sent to or from an actor: every state, and a store of the same bound there
        return ClientStore.holding, (self.bound, self.kept_folder(), self.as_dict())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the temporary folder goes with the machine's
            pass


def client_states(cfg: Any, initial: dict[int, Any] | None = None, purpose: str = "clients") -> MutableMapping:
    """The runtime's mapping of client states: a dict (``runtime.client_state_memory`` unset), or a
    :class:`ClientStore` bounded by it, in ``runtime.client_state_dir``/``purpose`` (a temporary folder when unset)."""
    bound = cfg.runtime.client_state_memory
    if bound is None:
        return dict(initial or {})
    root = cfg.runtime.client_state_dir
    return ClientStore.holding(bound, None if root is None else Path(root) / purpose, initial or {})


def as_dict(states: MutableMapping) -> dict[int, Any]:
    return states.as_dict() if isinstance(states, ClientStore) else dict(states)


__all__ = ["ClientStore", "as_dict", "client_states"]
