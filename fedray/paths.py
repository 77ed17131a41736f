"""Where a run's files are: folder paths recorded absolute, the config keys and environment variables that name
them, and the keys that say where the data comes from rather than what it is."""

from __future__ import annotations

import os


def absolute_path(path: str) -> str:
    """``path`` made independent of the current folder: a relative one is made absolute against it; one under
    ``~`` is left for each process to expand (its own home folder, on whichever node of a cluster it runs)."""
    return path if path.startswith("~") else os.path.abspath(path)


#: Config keys that name a folder or file (made absolute by validation, and by a sweep before its trials start)
PATH_KEYS = ("data.data_dir", "data.cache_dir", "system.trace", "system.availability_trace")
#: Config keys that say where the data comes from, not what it is: a resumed run may change them (the dataset
#: moved, another machine), and runs that differ in them alone are the same experiment
DATA_SOURCE_KEYS = (*PATH_KEYS[:2], "data.download", "data.cache")
#: Environment variables that name the default data and decoded-cache folders
DATA_DIR_ENV, CACHE_DIR_ENV = "FEDRAY_DATA_DIR", "FEDRAY_CACHE_DIR"


def anchor_path_env() -> None:
    """A relative ``$FEDRAY_DATA_DIR`` / ``$FEDRAY_CACHE_DIR`` made absolute in this process's environment,
    which the processes it starts inherit: a local Ray cluster's workers, and a sweep's trials, which Tune runs
    each in a folder of its own (where a relative folder would be another one, downloaded into anew)."""
    for var in (DATA_DIR_ENV, CACHE_DIR_ENV):
        if os.environ.get(var):
            os.environ[var] = absolute_path(os.environ[var])
