"""Errors a user can cause. The CLI turns each into one line on stderr and exit status 2."""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for (config, data path, resources), not a bug.

    ``key`` names the config field at fault (``data.alpha``) so the message can point at it.
    """

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class ConfigError(UserError):
    """A config key or value is wrong."""


class DataError(UserError):
    """A dataset cannot be found, read or partitioned as asked."""


class ResourceError(UserError):
    """The cluster cannot provide the CPUs/GPUs that the config asks for."""


class RunFailure(Exception):
    """A run that cannot go on (every upload non-finite, the server actor lost, no worker left).

    Not a bug and not bad input: the CLI prints it on one line, exits 1 and points at ``--resume``.
    """
