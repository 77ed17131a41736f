"""Pydantic's validation errors as one :class:`ConfigError` naming the key and what it takes.

Shared by the experiment config (:mod:`fedray.config`), a method's parameters (``algorithm.*``) and sweep specs
(:mod:`fedray.tuning`), so that a bad value reads alike wherever it is written.
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
        allowed = ", ".join(section.model_fields) if section else ""
        return ConfigError(_key(prefix, loc), f"unknown key; allowed keys here: {allowed}")
    if _is_union(root, loc[:-1]):
        members = [e["msg"].removeprefix("Input should be ").split(",")[0] for e in errors if e["loc"][:-1] == loc[:-1]]
        loc, msg = loc[:-1], "Input should be " + " or ".join(members)
    got = err.get("input")
    return ConfigError(_key(prefix, loc), msg if isinstance(got, dict) else f"{msg} (got {got!r})")


def section_model(root: type[BaseModel], loc) -> type[BaseModel] | None:
    """The model of the section at ``loc`` under ``root`` (None where ``loc`` is not a section)."""
    model = root
    for part in loc:
        ann = getattr(model.model_fields.get(str(part)), "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _is_union(root: type[BaseModel], loc) -> bool:
    """Whether the field at ``loc`` is a union of two or more types (``X | None`` alone gets no member errors)."""
    if not loc:
        return False
    ann = getattr(getattr(section_model(root, loc[:-1]), "model_fields", {}).get(str(loc[-1])), "annotation", None)
    members = [a for a in typing.get_args(ann) if a is not type(None)]
    return typing.get_origin(ann) in (typing.Union, types.UnionType) and len(members) > 1


def _key(prefix: str, loc) -> str:
    return prefix + ".".join(map(str, loc))
