"""Pydantic's validation errors as one :class:`ConfigError` naming the key and what it takes.

Shared by the experiment config (:mod:`fedray.config`), a method's parameters (``algorithm.*``) and sweep specs
(:mod:`fedray.sweep.spec`), so that a bad value reads alike wherever it is written.
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ValidationError

from fedray.errors import ConfigError


def config_error(e: ValidationError, root: type[BaseModel], prefix: str = "") -> ConfigError:
    """The error to raise for ``e``, from validating ``root``; its key is ``prefix`` + the dotted location.

    A :class:`ConfigError` raised inside a validator arrives wrapped and is returned unchanged. An unknown key
    lists the keys allowed beside it. A union's members (``auto | bool``) each report an error, located at the
    member's type (``runtime.vectorize.literal['auto']``, ``.bool``): they become one message for the key.
    """
    errors = e.errors()
    for err in errors:
        wrapped = (err.get("ctx") or {}).get("error")
        if isinstance(wrapped, ConfigError):
            return wrapped
    err = errors[0]
    loc, msg = err["loc"], err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        section = section_model(root, loc[:-1])
        allowed = f"; allowed keys here: {', '.join(section.model_fields)}" if section else ""
        return ConfigError(_key(prefix, loc), f"unknown key{allowed}")
    if _is_union(root, loc[:-1]):
        members = [e["msg"].removeprefix("Input should be ").split(",")[0] for e in errors if e["loc"][:-1] == loc[:-1]]
        loc, msg = loc[:-1], "Input should be " + " or ".join(members)
    got = err.get("input")
    return ConfigError(_key(prefix, loc), msg if isinstance(got, dict) else f"{msg} (got {got!r})")


def section_model(root: type[BaseModel], loc) -> type[BaseModel] | None:
    """The model of the section at ``loc`` under ``root`` (None where ``loc`` is not a section). A section may
    be optional (``X | None``) or one value of a mapping of sections (``dict[str, X]``: ``loc`` names its key)."""
    model, parts = root, [str(part) for part in loc]
    while parts:
        ann = _optional(getattr(model.model_fields.get(parts.pop(0)), "annotation", None))
        if typing.get_origin(ann) is dict and parts:
            parts.pop(0)
            ann = _optional(typing.get_args(ann)[1])
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _members(ann) -> list:
    """The types of a union annotation besides None (``[X]`` for ``X | None``); [] for anything else."""
    if typing.get_origin(ann) not in (typing.Union, types.UnionType):
        return []
    return [a for a in typing.get_args(ann) if a is not type(None)]


def _optional(ann):
    """``X`` for ``X | None``; anything else as it is."""
    members = _members(ann)
    return members[0] if len(members) == 1 else ann


def _is_union(root: type[BaseModel], loc) -> bool:
    """Whether the field at ``loc`` is a union of two or more types (``X | None`` alone gets no member errors)."""
    if not loc:
        return False
    ann = getattr(getattr(section_model(root, loc[:-1]), "model_fields", {}).get(str(loc[-1])), "annotation", None)
    return len(_members(ann)) > 1


def _key(prefix: str, loc) -> str:
    return prefix + ".".join(map(str, loc))
