"""Dotted keys on nested config dicts (``data.alpha=0.5``): how the CLI, presets, sweeps and reports address
one setting. Plain dicts only; the schema that validates the result is :mod:`fedray.config`'s."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from fedray.errors import ConfigError

STEPS, EPOCHS = "federation.local_steps", "federation.local_epochs"

STEPS, EPOCHS = "federation.local_steps", "federation.local_epochs"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested sections -> dotted keys (``{"data": {"alpha": 1}}`` -> ``{"data.alpha": 1}``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(text, "an override must look like key=value, e.g. data.alpha=0.5")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(text, "an override must look like key=value, e.g. data.alpha=0.5")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def apply_overrides(raw: dict, overrides: list[str] | dict[str, Any]) -> dict:
    """Set dotted keys in a nested dict (a copy). Values given as text are parsed as YAML scalars.

    Overriding ``algorithm.name`` with another method starts a fresh ``algorithm`` section: the options
    the base config gave belong to its own method (``fedcd_fmnist algorithm.name=local`` must not carry
    FedCD's ``lambda_kd``). It is applied before the other overrides, so ``algorithm.*`` overrides given
    with it, in any order, are kept.

    ``federation.local_steps`` is the budget only while ``federation.local_epochs`` is unset. Overriding
    the steps alone on a config that sets epochs (``fedkf_fmnist federation.local_steps=5``, or a sweep
    over steps) would change nothing, silently; so it unsets the base's ``local_epochs``. Overrides that
    give both keep the rule of the schema: the epochs decide unless null. (Not "the last one wins": a
    sweep's trial overrides are a dict merged from its spec and the sampled values, whose order is not
    the user's.)
    """
    out = copy.deepcopy(raw)
    items = list(overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides))
    if any(k == STEPS for k, _ in items) and not any(k == EPOCHS for k, _ in items):
        if isinstance(out.get("federation"), dict):
            out["federation"].pop("local_epochs", None)
    items.sort(key=lambda kv: kv[0] != "algorithm.name")  # stable: only moves algorithm.name first
    for key, value in items:
        section = out.get("algorithm")
        if key == "algorithm.name" and isinstance(section, dict) and section.get("name", value) != value:
            out["algorithm"] = {}
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section; cannot set " + key)
            node = child
        node[parts[-1]] = value
    return out
