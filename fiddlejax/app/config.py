"""Job configuration: the packaged YAML defaults, a user file, then dotted ``key=value`` overrides.

``fiddlejax/configs/default.yaml`` is the source of truth for the keys and their defaults; this
module types every key (:data:`SPECS`, a key without an entry takes its default's type) and checks
the merged config before anything is built, so a bad value fails in one line that names the key,
the value, what is expected and a fix (:class:`ConfigError`). Unknown keys are errors with a
"did you mean" (a typo must not silently train the wrong model). Override values are parsed as
YAML scalars so ``plan.zero=1``, ``optimizer.lr=1e-3`` and ``plan.schedule=null`` work.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fiddlejax import models
from fiddlejax.app.units import parse_bytes as _parse_bytes


class ConfigError(ValueError):
    """A bad config value or key; the message is one line that names the key and the fix."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one key accepts: a type, optional choices and bounds, null, and extra words."""

    kind: type  # int, float, bool, str, list or dict
    choices: tuple = ()  # allowed values; empty: any
    lo: float | None = None  # inclusive lower bound (exclusive when ``open_lo``)
    hi: float | None = None  # inclusive upper bound (exclusive when ``open_hi``)
    open_lo: bool = False
    open_hi: bool = False
    null: bool = False  # null is allowed
    words: tuple = ()  # strings a numeric key also takes ("auto")
    empty: bool = True  # a string key may be "" (paths may not: "" would mean "off" silently)

    def expected(self) -> str:
        if self.choices:
            extra = [repr(w) for w in self.words] + (["null"] if self.null else [])
            return _either([repr(c) for c in self.choices] + extra)
        if self.kind is bool:
            text = "true or false"
        elif self.kind is list:
            text = "a list, e.g. [a, b]"
        elif self.kind is dict:
            text = "a mapping, e.g. {a: b}"
        elif self.kind is str:
            text = "a string" if self.empty else "a non-empty string"
        else:
            text = "an integer" if self.kind is int else "a number"
            bounds = []
            if self.lo is not None:
                bounds.append(f"{'>' if self.open_lo else '>='} {_num(self.lo)}")
            if self.hi is not None:
                bounds.append(f"{'<' if self.open_hi else '<='} {_num(self.hi)}")
            text += (" " + " and ".join(bounds)) if bounds else ""
        extra = [repr(w) for w in self.words] + (["null"] if self.null else [])
        return _either([text, *extra]) if extra else text

    def ok(self, v: Any) -> bool:
        if v is None:
            return self.null
        if isinstance(v, str) and v in self.words:
            return True
        if self.kind is bool:
            return isinstance(v, bool)
        if self.kind is list:
            return isinstance(v, list)
        if self.kind is dict:
            return isinstance(v, dict)
        if self.kind is str:
            return (isinstance(v, str) and (not self.choices or v in self.choices)
                    and (self.empty or bool(v.strip())))
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False  # NaN passes every comparison, so it must be refused by name
        if self.choices and v not in self.choices:
            return False
        if self.kind is int and not isinstance(v, int):
            return False
        if self.lo is not None and (v <= self.lo if self.open_lo else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _either(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _kinds(module: str, attr: str) -> tuple:
    """Names from the module that owns them (so a new schedule kind or policy flows through)."""
    import importlib

    value = getattr(importlib.import_module(module), attr)
    return tuple(value() if callable(value) else value)


POSITIVE = Spec(int, lo=1)
COUNT = Spec(int, lo=0)
MESH_AXIS = Spec(int, lo=-1)  # -1 infers the axis from the device count
FRACTION = Spec(float, lo=0, hi=1, open_hi=True)
DIR = Spec(str, null=True, words=("auto",), empty=False)  # a directory, auto, or null (none)
MAX_CPU_DEVICES = 4096  # simulated: 4096 start in ~10 s; 100000 hang for minutes or crash

# Keys typed beyond their default's type. Choices that other modules own are filled in by
# :func:`specs` (schedule kinds, remat policies, all-reduce algorithms).
SPECS: dict[str, Spec] = {
    "model.name": Spec(str, choices=models.NAMES),
    "model.vocab_size": Spec(int, lo=2, words=("auto",)),  # auto: the tokenizer's
    "model.seq_len": POSITIVE, "model.d_model": POSITIVE, "model.n_heads": POSITIVE,
    "model.n_layers": POSITIVE, "model.d_ff": POSITIVE, "model.channels": POSITIVE,
    "model.tie_embeddings": Spec(bool), "model.from_pretrained": Spec(str, null=True),
    "model.n_kv_heads": POSITIVE, "model.rope_theta": Spec(float, lo=0, open_lo=True),
    "model.bias_update_speed": Spec(float, lo=0),
    "mesh.data": MESH_AXIS, "mesh.pipe": MESH_AXIS, "mesh.tensor": MESH_AXIS,
    "mesh.context": MESH_AXIS, "mesh.expert": MESH_AXIS,
    "plan.schedule": Spec(str, null=True),  # choices: the schedule registry
    "plan.microbatches": POSITIVE, "plan.virtual_stages": Spec(int, lo=1, null=True),
    "plan.remat": Spec(str),  # choices: fiddlejax.memory.policies
    "plan.encodings": Spec(list, null=True), "plan.grad_allreduce": Spec(str),  # collectives'
    "plan.topk_density": Spec(float, lo=0, hi=1, open_lo=True),
    "plan.topk_on": Spec(str, choices=("gradients", "updates")),
    "plan.zero": Spec(int, choices=(0, 1, 2, 3), words=("auto",)),
    "plan.compute_dtype": Spec(str, choices=("float32", "bfloat16", "float16", "auto")),
    "plan.fsdp_gather": Spec(str, choices=("layer", "step")), "plan.fsdp_prefetch": Spec(bool),
    "plan.matmul_dtype": Spec(str, choices=("fp8",), null=True),
    "plan.partition": Spec(str, choices=("uniform", "params", "cost")),
    "plan.check_inputs": Spec(bool), "plan.sequence_parallel": Spec(bool),
    "plan.unroll_layers": Spec(bool, null=True), "plan.rules": Spec(dict, null=True),
    "optimizer.name": Spec(str, choices=("adamw", "muon")),
    "optimizer.lr": Spec(float, lo=0, open_lo=True),
    "optimizer.muon_lr": Spec(float, lo=0, open_lo=True),
    "optimizer.warmup_steps": COUNT, "optimizer.weight_decay": Spec(float, lo=0),
    "optimizer.b1": FRACTION, "optimizer.b2": FRACTION, "optimizer.nesterov": Spec(bool),
    "optimizer.stale_correction": Spec(float, lo=0, hi=1), "optimizer.clip": Spec(float, lo=0),
    "data.batch_size": POSITIVE, "data.seed": COUNT, "data.format": Spec(str),
    "data.field": Spec(str), "data.tokenizer": Spec(str), "data.pack": Spec(bool),
    "data.val_fraction": Spec(float, lo=0, hi=1, open_lo=True, open_hi=True, null=True),
    "data.eos_id": Spec(int, lo=0, null=True), "data.workers": COUNT,
    "data.token_dtype": Spec(str, choices=("uint16", "uint32")), "data.allow_change": Spec(bool),
    "data.cache_dir": Spec(str, null=True, empty=False), "data.chat_template": Spec(str, null=True),
    "train.steps": POSITIVE, "train.log_every": POSITIVE, "train.eval_every": COUNT,
    "train.eval_batches": COUNT, "train.steps_per_call": POSITIVE, "train.seed": COUNT,
    "run.dir": Spec(str, empty=False), "run.cpu_devices": Spec(int, lo=0, hi=MAX_CPU_DEVICES),
    "run.peak_tflops": Spec(float, lo=0), "init_from": Spec(str, null=True),
    "run.progress": Spec(str, choices=("auto", "bar", "lines")), "run.compile_cache": DIR,
    "train.nonfinite": Spec(str, choices=("skip", "stop")), "train.nonfinite_limit": POSITIVE,
    "checkpoint.dir": DIR, "checkpoint.every": Spec(int, lo=1, words=("auto",)),  # auto: run.dir/..
    "checkpoint.checkfreq_overhead": Spec(float, lo=0, hi=1, open_lo=True, open_hi=True),
    "checkpoint.max_to_keep": Spec(int, lo=1, null=True), "checkpoint.async": Spec(bool),
    "checkpoint.best_metric": Spec(str, null=True),
    "checkpoint.best_mode": Spec(str, choices=("min", "max")),
    "resume": Spec(int, lo=1, null=True, words=("auto",)),
}

MAPPINGS = ("plan.rules", "plan.lora")  # free mappings: plan.rules.kv=tensor merges into one

# A fix for a key whose bad value the default alone does not explain.
HINTS = {
    "checkpoint.every": "a step count such as checkpoint.every=100, or checkpoint.every=auto "
                        "(CheckFreq picks it)",
    "resume": "resume=auto continues from the latest checkpoint, resume=N from step N",
    "plan.memory_budget": "bytes per device, e.g. plan.memory_budget=2GiB",
    "mesh.data": "a device count, or -1 to use the devices the other axes leave",
    "mesh.context": "splits every sequence over this many devices (ring attention; "
                    "seq_len a multiple of 2 x context)",
    "checkpoint.dir": "checkpoint.dir=auto saves under run.dir/checkpoints, checkpoint.dir=DIR "
                      "in DIR, checkpoint.dir=null saves nothing",
    "plan.rules": "logical axis name -> mesh axis, e.g. plan.rules={mlp: null, kv_heads: null}",
    "run.cpu_devices": f"0 (real devices) or up to {MAX_CPU_DEVICES}, e.g. run.cpu_devices=8",
    "run.dir": "the directory for logs and checkpoints, e.g. run.dir=runs/default",
}


def specs() -> dict[str, Spec]:
    """:data:`SPECS` with the names other modules own filled in."""
    out = dict(SPECS)
    out["plan.schedule"] = Spec(str, null=True, choices=_kinds(
        "fiddlejax.pipeline.schedules", "kinds"))
    out["plan.remat"] = Spec(str, choices=(*_kinds("fiddlejax.memory.policies", "POLICY_NAMES"),
                                           "auto"))
    out["plan.grad_allreduce"] = Spec(str, choices=(
        *_kinds("fiddlejax.collectives", "ALGORITHMS"), "topk"))
    return out


def checkpoint_dir(cfg: dict) -> str | None:
    """Where the job saves checkpoints: ``checkpoint.dir``, with ``auto`` (the default) the
    run's own ``<run.dir>/checkpoints``; None when checkpointing is off (``null``)."""
    d = cfg["checkpoint"]["dir"]
    if d == AUTO_CHECKPOINT_DIR:
        return str(Path(cfg["run"]["dir"]) / "checkpoints")
    return d or None


AUTO_CHECKPOINT_DIR = "auto"


def defaults() -> dict:
    text = resources.files("fiddlejax").joinpath("configs/default.yaml").read_text()
    return yaml.safe_load(text)


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
        spec = table.get(key) or _inferred(base.get(key))
        if spec is None or spec.ok(value):
            continue
        if spec.choices and isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in spec.choices], n=1)
            if close:
                raise _fail(key, value, spec.expected(), f"did you mean {key}={close[0]}?")
        default = base.get(key)
        fix = HINTS.get(key) or (f"e.g. {key}={_yaml(default)} (the default)"
                                 if spec.ok(default) else f"see {key} in default.yaml")
        expected = spec.expected()
        if isinstance(value, float) and not math.isfinite(value):  # NaN, inf: named as such
            expected = expected.replace("a number", "a finite number", 1)
        raise _fail(key, value, expected, fix)
    if cfg["plan"]["memory_budget"] is not None:
        parse_bytes(cfg["plan"]["memory_budget"], "plan.memory_budget")
    _check_combinations(cfg)


def _inferred(default: Any) -> Spec | None:
    """The spec of a key :data:`SPECS` does not list: its default's type (null: anything)."""
    if default is None:
        return None
    if isinstance(default, bool):
        return Spec(bool)
    if isinstance(default, int):
        return Spec(int)
    if isinstance(default, float):
        return Spec(float)
    return Spec(type(default)) if isinstance(default, str | list) else None


def _yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


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
