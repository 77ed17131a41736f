"""Reading an experiment config: a preset name or a YAML file, plus dotted overrides (``a.b.c=value``), validated
into the typed :class:`~fedray.config.ExperimentConfig` (whose keys and checks live in :mod:`fedray.config`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fedray.config import ExperimentConfig
from fedray.errors import ConfigError
from fedray.overrides import apply_overrides
from fedray.validation import config_error

PRESET_DIR = Path(__file__).parent / "configs"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _read_yaml(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = PRESET_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise ConfigError(
                "config",
                f"'{name_or_path}' is neither a preset nor a YAML file; presets: {', '.join(preset_names())}",
            )
    if not path.exists():
        raise ConfigError("config", f"file {path} does not exist; give a YAML path or a preset name")
    return read_yaml_mapping(path, "config")


def read_yaml_mapping(path: Path, key: str) -> dict:
    """A YAML file that must hold a mapping; errors name ``key`` (the argument that gave the path)."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(key, f"{path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(key, f"{path} must hold a mapping of keys, got {type(raw).__name__}")
    return raw


def validate_config(raw: dict) -> ExperimentConfig:
    """Validate a nested dict into an :class:`ExperimentConfig`.

    The algorithm's own parameters and the model names are checked against their registries by
    :func:`fedray.methods.validate_experiment` (this module imports no method and no model).
    """
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise config_error(e, ExperimentConfig) from None


def load_config(
    name_or_path: str | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> ExperimentConfig:
    """Load a preset name or YAML path (or the defaults when None) and apply dotted overrides."""
    raw = _read_yaml(name_or_path) if name_or_path else {}
    return validate_config(apply_overrides(raw, overrides or []))
