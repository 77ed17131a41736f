"""fedray.validation: pydantic's errors as one ConfigError naming the key."""

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedray.validation import config_error


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = Field(default=1, ge=1)
    mode: Literal["auto"] | bool = "auto"


class Root(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inner: Inner = Inner()
    maybe: Inner | None = None  # X | None: errors inside it are the section's, not a union's members
    named: dict[str, Inner] = {}  # a mapping of sections (a sweep spec's search dimensions)


def _error(raw, prefix=""):
    with pytest.raises(ValidationError) as e:
        Root.model_validate(raw)
    return config_error(e.value, Root, prefix)


@pytest.mark.parametrize("raw, key, message", [
    ({"inner": {"mode": "maybe"}}, "inner.mode", "Input should be 'auto' or a valid boolean (got 'maybe')"),
    ({"inner": {"size": 0}}, "inner.size", "Input should be greater than or equal to 1 (got 0)"),
    ({"maybe": {"size": 0}}, "maybe.size", "Input should be greater than or equal to 1 (got 0)"),
    ({"maybe": {"size": 0, "mode": 2}}, "maybe.size", "Input should be greater than or equal to 1 (got 0)"),
    ({"inner": {"sise": 2}}, "inner.sise", "unknown key; allowed keys here: size, mode"),
    ({"maybe": {"sise": 2}}, "maybe.sise", "unknown key; allowed keys here: size, mode"),
    ({"named": {"a": {"sise": 2}}}, "named.a.sise", "unknown key; allowed keys here: size, mode"),
    ({"named": {"a": {"size": 0}}}, "named.a.size", "Input should be greater than or equal to 1 (got 0)"),
    ({"colour": 1}, "colour", "unknown key; allowed keys here: inner, maybe, named"),
])
def test_an_error_names_its_key_and_what_the_key_takes(raw, key, message):
    err = _error(raw)
    assert (err.key, err.message) == (key, message)


def test_a_prefix_leads_the_key():
    assert _error({"inner": {"size": 0}}, "algorithm.").key == "algorithm.inner.size"
