"""Job configuration: the defaults, a user's YAML file, then dotted ``key=value`` overrides.

The keys, their defaults, types and fixes are declared once in :mod:`fiddlejax.app.schema`
(``fiddlejax/configs/default.yaml`` is generated from it). This module merges a job's config
onto the defaults and checks it before anything is built, so a bad value fails in one line
that names the key, the value, what is expected and a fix (:class:`ConfigError`). Unknown
keys are errors with a "did you mean" (a typo must not silently train the wrong model).
Override values are parsed as YAML scalars so ``plan.zero=1``, ``optimizer.lr=1e-3`` and
``plan.schedule=null`` work.
"""

from __future__ import annotations

import copy
import difflib
import math
from pathlib import Path
from typing import Any

import yaml

from fiddlejax import models
from fiddlejax.app import schema
from fiddlejax.app.schema import MAX_CPU_DEVICES  # noqa: F401 (a name users import)
from fiddlejax.app.spec import Spec, inferred
from fiddlejax.app.units import parse_bytes as _parse_bytes


class ConfigError(ValueError):
    """A bad config value or key; the message is one line that names the key and the fix."""


# Derived from the schema (fiddlejax.app.schema): each key is declared there once.
SPECS: dict[str, Spec] = {k: d.accepts for k, _, d in schema.entries() if d.accepts}
HINTS: dict[str, str] = {k: d.fix for k, _, d in schema.entries() if d.fix}
# Free mappings: plan.rules.kv=tensor merges into the mapping instead of replacing it.
MAPPINGS = tuple(k for k, spec in SPECS.items() if spec.kind is dict)


def specs() -> dict[str, Spec]:
    """Every key's spec (declared, else its default's type), other modules' choices read."""
    out = {k: s for k, default, _ in schema.entries() if (s := inferred(default))}
    return out | {k: spec.resolved() for k, spec in SPECS.items()}


def checkpoint_dir(cfg: dict) -> str | None:
    """Where the job saves checkpoints: ``checkpoint.dir``, with ``auto`` (the default) the
    run's own ``<run.dir>/checkpoints``; None when checkpointing is off (``null``)."""
    d = cfg["checkpoint"]["dir"]
    if d == AUTO_CHECKPOINT_DIR:
        return str(Path(cfg["run"]["dir"]) / "checkpoints")
    return d or None


AUTO_CHECKPOINT_DIR = "auto"


def defaults() -> dict:
    """The default config (a fresh copy: callers may change it)."""
    return schema.defaults()


def leaves(cfg: dict, where: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every non-section key of ``cfg``."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and f"{where}{k}" not in MAPPINGS:
            out.update(leaves(v, f"{where}{k}."))
        else:
            out[f"{where}{k}"] = v
    return out


# Other libraries' names for a leaf within its section: what users type first.
ALIASES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "grad_clip": "clip",
           "warmup": "warmup_steps", "max_seq_len": "seq_len", "num_layers": "n_layers"}


def _suggest(word: str, known: list[str], where: str = "") -> str:
    names = {k: k for k in known} | {a: k for a, k in ALIASES.items() if k in known}
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return f"; did you mean {where + names[close[0]]!r}?" if close else ""


def _merge(base: dict, new: dict, where: str = "") -> dict:
    out = copy.deepcopy(base)
    for k, v in new.items():
        key = f"{where}{k}"
        if k not in base:
            known = list(leaves(defaults()))
            hint = (where and _suggest(str(k), list(base), where)) or _suggest(
                key, known + sorted({n.rsplit(".", 1)[0] for n in known}))
            raise ConfigError(f"unknown config key {key!r}"
                              + (hint or f"; known keys here: {sorted(base)}"))
        if key in MAPPINGS:
            out[k] = {**base[k], **v} if isinstance(base[k], dict) and isinstance(v, dict) else v
        elif isinstance(base[k], dict):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key!r} is a section; give {key}.<field>=value")
            out[k] = _merge(base[k], v, key + ".")
        else:
            out[k] = v
    return out


def parse_override(item: str) -> dict:
    """``"a.b=3"`` -> ``{"a": {"b": 3}}``."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. train.steps=100)")
    key, value = item.split("=", 1)
    try:
        parsed: Any = yaml.safe_load(value) if value else ""
    except yaml.YAMLError:  # e.g. "a: b": keep the text; the key's type check reports it
        parsed = value
    if isinstance(parsed, str):
        try:  # YAML 1.1 reads "1e-3" as a string
            parsed = float(parsed)
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        if not part:
            raise ConfigError(f"override {item!r} has an empty key part")
        parsed = {part: parsed}
    return parsed


def _read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"--config {path} {why}; give the path of a YAML file of overrides "
                          "(see fiddlejax/configs/default.yaml for the keys)")
    try:
        with p.open() as f:
            user = yaml.safe_load(f) or {}
    except (UnicodeDecodeError, OSError) as e:  # a binary file, an unreadable one
        why = (f"not text: byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8"
               if isinstance(e, UnicodeDecodeError) else f"unreadable: {e.strerror or e}")
        raise ConfigError(f"--config {path} is {why}; give a YAML file of overrides") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path} is not valid YAML: {problem}{where}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"--config {path} must hold a mapping of keys (e.g. 'train: {{steps: "
                          f"50}}'), got a {type(user).__name__}")
    return user


def load(path: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """Defaults, then the YAML file at ``path``, then each ``key=value`` override; validated."""
    cfg = defaults()
    if path is not None:
        cfg = _merge(cfg, _read_file(path))
    for item in overrides:
        cfg = _merge(cfg, parse_override(item))
    validate(cfg)
    try:
        models.resolve_name(cfg["model"])  # auto: gpt, or model.from_pretrained's family
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    return cfg


def _fail(key: str, value: Any, expected: str, fix: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} must be {expected}; {fix}")


def validate(cfg: dict) -> None:
    """Check every key's type and range, then the combinations; raise :class:`ConfigError`."""
    table, base = specs(), leaves(defaults())
    for key, value in leaves(cfg).items():
        spec = table.get(key)
        if spec is None or spec.ok(value):
            continue
        if spec.choices and isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in spec.choices], n=1)
            if close:
                raise _fail(key, value, spec.expected(), f"did you mean {key}={close[0]}?")
        default = base.get(key)
        fix = HINTS.get(key) or (f"e.g. {key}={schema.as_yaml(default)} (the default)"
                                 if spec.ok(default) else f"see {key} in default.yaml")
        expected = spec.expected()
        if isinstance(value, float) and not math.isfinite(value):  # NaN, inf: named as such
            expected = expected.replace("a number", "a finite number", 1)
        raise _fail(key, value, expected, fix)
    if cfg["plan"]["memory_budget"] is not None:
        parse_bytes(cfg["plan"]["memory_budget"], "plan.memory_budget")
    _check_combinations(cfg)


def _check_combinations(cfg: dict) -> None:
    p, mesh = cfg["plan"], cfg["mesh"]
    if p["schedule"] is None and mesh["pipe"] not in (1,):
        raise ConfigError(
            f"plan.schedule=null (no pipeline) needs mesh.pipe=1, got mesh.pipe={mesh['pipe']}; "
            "set mesh.pipe=1 or pick a schedule, e.g. plan.schedule=1f1b")
    if p["schedule"] is not None and mesh["pipe"] == 1:
        raise ConfigError(
            f"plan.schedule={p['schedule']} needs a pipeline (mesh.pipe > 1), but mesh.pipe=1; "
            "set plan.schedule=null, or mesh.pipe=2 or more")
    axes, n = list(mesh.values()), cfg["run"]["cpu_devices"]
    if mesh["data"] > 0 and not (n and min(axes) > 0 and math.prod(axes) != n):
        check_batch(cfg, mesh["data"])  # else a mesh problem, which the job names with devices
    t, c = cfg["train"], cfg["checkpoint"]
    if cfg["resume"] is not None and not c["dir"]:
        raise ConfigError(f"resume={cfg['resume']} needs checkpoints: checkpoint.dir=auto (under "
                          "run.dir) or checkpoint.dir=DIR, the directory that holds them")
    if isinstance(cfg["resume"], int) and cfg["resume"] > t["steps"]:
        raise ConfigError(f"resume={cfg['resume']} is after train.steps={t['steps']}; resume "
                          "from an earlier step or raise train.steps")


def check_batch(cfg: dict, data: int) -> None:
    """``data.batch_size`` must split over ``data`` replicas x ``plan.microbatches``."""
    b, m = cfg["data"]["batch_size"], cfg["plan"]["microbatches"]
    if b % (data * m):
        per = data * m
        raise ConfigError(
            f"data.batch_size={b} must be a multiple of mesh.data={data} x plan.microbatches={m} "
            f"= {per} (each replica splits its rows into microbatches); e.g. "
            f"data.batch_size={max(per, b - b % per)}")


def parse_bytes(value: Any, key: str = "bytes") -> int:
    """``2GiB``, ``512MB``, ``1e9`` or an int -> bytes (> 0); a ConfigError otherwise."""
    try:
        return _parse_bytes(value, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
