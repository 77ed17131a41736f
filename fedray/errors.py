"""Errors a user can cause. The CLI turns each into one line on stderr and exit status 2."""

from __future__ import annotations

import contextlib
import threading


class UserError(Exception):
    """A problem with what the user asked for (config, data path, resources), not a bug.

    ``key`` names the config field at fault (``data.alpha``) so the message can point at it.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self):  # pickled by Ray (a trial's or a task's error): rebuilt from both fields
        return type(self), (self.key, self.message)


class ConfigError(UserError):
    """A config key or value is wrong."""


def refuse_unread_keys(config, section: str, selector: str, readers: dict[str, tuple[str, ...]]) -> None:
    """ConfigError for a key of ``config`` (a pydantic section) set away from its default that the chosen value of
    ``selector`` does not read (``readers``: each value's keys): it would change nothing, so it is refused naming
    the values that read it."""
    default, chosen = type(config)(), getattr(config, selector)
    for key in sorted({k for keys in readers.values() for k in keys}):
        if key not in readers[chosen] and getattr(config, key) != getattr(default, key):
            which = [value for value, keys in readers.items() if key in keys]
            raise ConfigError(f"{section}.{key}", f"is only read with {section}.{selector}={' or '.join(which)}")


class DataError(UserError):
    """A dataset cannot be found, read or partitioned as asked."""


class ResourceError(UserError):
    """The cluster cannot provide the CPUs/GPUs that the config asks for."""


class RunFailure(Exception):
    """A run that cannot go on (every upload non-finite, a server actor lost, no worker left).

    Not a bug and not bad input: the CLI prints it on one line, exits 1 and points at ``--resume`` when a checkpoint
    was written and resuming can help; ``resumable=False`` for a cause that a resume of the same config would meet
    again (its message names the key to change instead).
    """

    def __init__(self, message: str, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable


_INTERRUPTED = threading.Event()


class _Deferral:
    depth = 0  # interrupts_deferred blocks entered
    pending = False  # an interrupt arrived inside one: raised when the outermost ends


def interrupt(signum=None, frame=None) -> None:
    """Ctrl-C / SIGTERM handler: remember the interrupt, then raise KeyboardInterrupt (inside
    :func:`interrupts_deferred`, when the block ends; a second interrupt at once).

    Remembered because Python drops an exception raised while a finaliser runs ("Exception ignored in
    ... __del__"), and Ray runs many: long loops call :func:`check_interrupted` at safe points, so a
    Ctrl-C that landed in one still stops them.
    """
    again = record_interrupt()
    if _Deferral.depth and not again:
        _Deferral.pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_deferred():
    """A block no first Ctrl-C / SIGTERM cuts in half: :func:`interrupt` raises its KeyboardInterrupt when the
    block ends (a second interrupt still raises at once, for a write that hangs). For MLflow writes: one cut
    mid-transaction can leave a SQLite store locked, and then the run's end status cannot be written (seen as
    "database is locked", exit status 1 and a run left RUNNING after a SIGTERM)."""
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
        pending = _Deferral.depth == 0 and _Deferral.pending
        if pending:
            _Deferral.pending = False
    if pending:
        raise KeyboardInterrupt


def record_interrupt() -> bool:
    """Remember an interrupt without raising; True if one was already recorded (a second Ctrl-C)."""
    again = _INTERRUPTED.is_set()
    _INTERRUPTED.set()
    return again


def check_interrupted() -> None:
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


def clear_interrupted() -> None:
    _INTERRUPTED.clear()
