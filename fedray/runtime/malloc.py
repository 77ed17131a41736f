"""glibc's malloc, set to keep the memory a training process frees for its next batch.

By default glibc returns freed memory to the OS at once: a block over its (dynamic) mmap threshold is unmapped
when freed, and the top of the heap is trimmed once more than twice that threshold is free. A forward pass
frees its activations together at its end, so the heap's top is trimmed after every batch and the next
batch's activations are page-faulted in again, page by page. On this project's 2-core CPU machine
(``benchmarks/speed/cpu_malloc.py``, one thread, its first run) that was ~160,000 minor faults per in-process round
of 8 ResNet-8 clients x 5 SGD steps of 32 (1.46 s a round; 1.17 s without them) and ~1.8 million per
evaluation of ResNet-8 on 22,000 images (8.9 s; 6.1 s without them); ResNet-8-BN evaluated in 9.6 s, 6.0 s
without.
:func:`keep_freed_memory` fixes both thresholds instead: blocks up to 32 MiB (the ceiling of glibc's own dynamic
threshold on 64-bit) come from the heap, and up to 256 MiB of free heap top is kept. The cost is memory that
stays with the process after a peak, up to 256 MiB; the peak itself did not grow in those runs.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_applied = False


def glibc() -> bool:
    """Whether this process runs on glibc (``mallopt`` and these parameters exist)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # not a GNU system (macOS, Windows, musl)
        return False


def keep_freed_memory(enabled: bool = True) -> bool:
    """Set this process's malloc thresholds (see the module docstring) once, if ``enabled`` and on glibc;
    whether they are set. Process-wide and for the process's lifetime: glibc cannot go back to its dynamic
    thresholds, which is why ``runtime.malloc_tuning=false`` leaves a process untouched."""
    global _applied
    if _applied or not enabled or not glibc():
        return _applied
    libc = ctypes.CDLL(None)  # the process's own C library
    _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                       TRIM_THRESHOLD))
    return _applied
