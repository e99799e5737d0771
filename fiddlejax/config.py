"""Job configuration: the packaged YAML defaults, a user file, then dotted ``key=value`` overrides.

Unknown keys are errors (a typo must not silently train the wrong model), and override values are
parsed as YAML scalars so ``plan.zero=1``, ``optimizer.lr=1e-3`` and ``plan.schedule=null`` work.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


def defaults() -> dict:
    text = resources.files("fiddlejax").joinpath("configs/default.yaml").read_text()
    return yaml.safe_load(text)


def _merge(base: dict, new: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for k, v in new.items():
        key = f"{where}{k}"
        if k not in base:
            raise ValueError(f"unknown config key {key!r}; known keys here: {sorted(base)}")
        if isinstance(base[k], dict):
            if not isinstance(v, dict):
                raise ValueError(f"config key {key!r} is a section; give {key}.<field>=value")
            out[k] = _merge(base[k], v, key + ".")
        else:
            out[k] = v
    return out


def parse_override(item: str) -> dict:
    """``"a.b=3"`` -> ``{"a": {"b": 3}}``."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value (e.g. train.steps=100)")
    key, value = item.split("=", 1)
    parsed: Any = yaml.safe_load(value) if value else ""
    if isinstance(parsed, str):
        try:  # YAML 1.1 reads "1e-3" as a string
            parsed = float(parsed)
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        if not part:
            raise ValueError(f"override {item!r} has an empty key part")
        parsed = {part: parsed}
    return parsed


def load(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """Defaults, then the YAML file at ``path``, then each ``key=value`` override."""
    cfg = defaults()
    if path is not None:
        user = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(user, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(user).__name__}")
        cfg = _merge(cfg, user)
    for item in overrides:
        cfg = _merge(cfg, parse_override(item))
    return cfg
