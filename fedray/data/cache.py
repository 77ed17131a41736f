"""A cache of decoded datasets: each split's uint8 images and labels as ``.npy`` files, memory-mapped.

Decoding is the slow part of loading a dataset the second time (torchvision parses IDX / pickle / ``.mat``
files, and importing torchvision alone imports torch's compiler stack, ~2 s of CPU); reading a ``.npy``
with ``mmap_mode="r"`` costs milliseconds, and the pages are shared by every process on the machine that
maps the same file.

Where: ``data.cache_dir``, else ``$FEDRAY_CACHE_DIR``, else ``~/.cache/fedray/decoded``; ``data.cache=false``
turns it off. One entry per dataset (and EMNIST split), named by a fingerprint of its source files
(relative path, size, modification time) and of this module's format version: new or changed source
files give another name, and the stale entry is removed once the new one is written.

Safety: every file is written under a temporary name in the same folder and renamed into place (atomic on
POSIX), the metadata file last, so a reader never sees a half-written entry and concurrent writers (two runs,
several Ray workers) each leave a complete one. An entry that fails to load or does not match its
metadata (truncated, overwritten, hand-edited) is reported with a warning and rebuilt from the sources. A
cache folder that cannot be created or written is not an error: the run goes on, decoding as without a
cache, with one warning naming the folder and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from fedray.paths import CACHE_DIR_ENV

log = logging.getLogger("fedray")

#: Bumped when what is stored, or how, changes: older entries then miss and are rebuilt.
FORMAT_VERSION = 1
ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedray" / "decoded"


def fingerprint(label: str, sources: list[Path], root: Path) -> str | None:
    """A name for the decoded form of ``sources`` (files, or folders taken whole); None when one is missing
    (nothing to key on yet: the loader will download or fail)."""
    files = []
    for src in sources:
        if src.is_file():
            found = [src]
        elif src.is_dir():
            found = sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
        else:
            return None
        for p in found:
            st = p.stat()
            files.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    if not files:
        return None
    blob = json.dumps([FORMAT_VERSION, label, files], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


class DecodedCache:
    """The entries of one dataset (``label``, e.g. ``fashion_mnist`` or ``emnist-letters``) in ``folder``."""

    def __init__(self, folder: Path, label: str):
        self.dir = Path(folder).expanduser() / label
        self.label = label

    def _path(self, key: str, name: str) -> Path:
        return self.dir / f"{key}.{name}"

    def load(self, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
        """(arrays, metadata) of entry ``key``, memory-mapped read-only; None on a miss. A damaged entry is
        removed (with a warning) and counts as a miss."""
        meta_path = self._path(key, "json")
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            arrays = {}
            for name in ARRAYS:
                a = np.load(self._path(key, f"{name}.npy"), mmap_mode="r", allow_pickle=False)
                want = meta["arrays"][name]
                if list(a.shape) != want["shape"] or a.dtype.str != want["dtype"]:
                    raise ValueError(f"{name} is {a.dtype.str} {list(a.shape)}, its metadata says "
                                     f"{want['dtype']} {want['shape']}")
                arrays[name] = a.view(np.ndarray)  # a plain array over the mapped pages
            return arrays, meta
        except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
            log.warning("the decoded-dataset cache entry %s is damaged (%s); rebuilding it from the dataset's "
                        "files", meta_path, e)
            self._remove(key)
            return None

    def save(self, key: str, arrays: dict[str, np.ndarray], meta: dict) -> bool:
        """Write entry ``key`` (arrays, then the metadata that marks it complete) and drop stale entries;
        False, with a warning, when the folder cannot be written."""
        meta = {**meta, "format": FORMAT_VERSION,
                "arrays": {n: {"shape": list(a.shape), "dtype": a.dtype.str} for n, a in arrays.items()}}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for name, a in arrays.items():
                self._write(self._path(key, f"{name}.npy"), lambda f, a=a: np.save(f, np.ascontiguousarray(a),
                                                                                     allow_pickle=False))
            self._write(self._path(key, "json"), lambda f: f.write(json.dumps(meta).encode()))
        except OSError as e:
            log.warning("cannot write the decoded-dataset cache in %s (%s); going on without it (set data.cache_dir "
                        "or $%s to a writable folder, or data.cache=false)", self.dir, e.strerror or e, CACHE_DIR_ENV)
            return False
        for stale in self.dir.glob("*"):  # other fingerprints: older source files, or another data root
            if not stale.name.startswith((f"{key}.", ".")):
                try:
                    stale.unlink()
                except OSError:
                    pass
        return True

    def _write(self, path: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache must stay readable
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _remove(self, key: str) -> None:
        for p in self.dir.glob(f"{key}.*"):
            try:
                p.unlink()
            except OSError:
                pass
