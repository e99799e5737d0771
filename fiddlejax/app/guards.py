"""What ``fiddlejax train`` refuses before it allocates anything, in the job's own keys.

The config schema (:mod:`fiddlejax.app.config`) types each key alone; these checks need another
module's names (the logical axes of :mod:`fiddlejax.sharding`, the metrics the job records) or
the machine (its memory, its devices and their platform). Each raises
:class:`~fiddlejax.app.config.ConfigError` (exit status 2) naming the key, the value and the fix:

- :func:`check_config` (no device touched): ``plan.rules`` names, ``checkpoint.best_metric``,
  a batch that cannot fit in this machine's memory (it would hang filling it).
- :func:`check_devices` (devices known, nothing allocated): the mesh against the device count
  (before the batch-size check, whose fix would be wrong for a mesh problem), and
  ``plan.compute_dtype=float16`` on the CPU, whose XLA has no float16 matmul.
"""

from __future__ import annotations

import difflib
import math
import os

from fiddlejax.app.config import ConfigError, check_batch

# What checkpoint.best_metric may rank by: the job's numeric records (app/train.py's ``rec``).
BEST_METRICS = ("loss", "val_loss", "val_accuracy", "grad_norm")
TOKEN_BYTES = 4  # int32 token ids


def _close(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def check_config(cfg: dict) -> None:
    """The checks that need no device (run before JAX starts)."""
    _check_rules(cfg["plan"].get("rules"))
    _check_best_metric(cfg)
    _check_batch_memory(cfg)


def _check_rules(rules: dict | None) -> None:
    from fiddlejax.mesh import AXES
    from fiddlejax.sharding import DEFAULT_RULES

    for name, axis in (rules or {}).items():
        if name not in DEFAULT_RULES:
            raise ConfigError(
                f"plan.rules has an unknown logical axis {name!r} (it would shard nothing); "
                f"{_close(str(name), DEFAULT_RULES)}the models' logical axes are "
                f"{sorted(DEFAULT_RULES)}")
        axes = axis if isinstance(axis, list | tuple) else [axis]
        bad = [a for a in axes if a is not None and a not in AXES]
        if bad:
            raise ConfigError(f"plan.rules.{name}={axis!r} names no mesh axis; use one of "
                              f"{list(AXES)} or null (replicated)")


def _check_best_metric(cfg: dict) -> None:
    metric, t = cfg["checkpoint"]["best_metric"], cfg["train"]
    if metric is None:
        return
    if metric not in BEST_METRICS:
        raise ConfigError(
            f"checkpoint.best_metric={metric!r} is not a metric the job records; "
            f"{_close(metric, BEST_METRICS)}use one of {list(BEST_METRICS)} or null")
    if metric.startswith("val_") and not (t["eval_every"] and t["eval_batches"]):
        raise ConfigError(
            f"checkpoint.best_metric={metric} needs validation, but train.eval_every="
            f"{t['eval_every']} train.eval_batches={t['eval_batches']} compute none; set both "
            "above 0, or checkpoint.best_metric=loss")


def host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_batch_memory(cfg: dict) -> None:
    """A batch whose token ids alone exceed the machine's memory would be filled until the
    machine swaps or the process is killed (a 2**40 batch grew ~10 MB/s, silently)."""
    b, mem = cfg["data"]["batch_size"], host_memory()
    seq = cfg["model"].get("seq_len") or 1
    need = b * (seq + 1) * TOKEN_BYTES
    if mem and need > mem:
        raise ConfigError(
            f"data.batch_size={b} is too large: one batch of (model.seq_len={seq} + 1) int32 "
            f"token ids takes {_size(need)}, more than this machine's {_size(mem)} of memory "
            "(before any activation); lower it, e.g. data.batch_size=32")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def check_devices(cfg: dict) -> None:
    """The checks that need the devices (run after they are set up, before any allocation)."""
    import jax

    mesh, n = cfg["mesh"], jax.device_count()
    keys = " x ".join(f"mesh.{k}={v}" for k, v in mesh.items()
                      if k not in ("context", "expert") or v != 1)  # unused splits go unsaid
    where = (f"this run has {n} devices"
             + (f" (run.cpu_devices={cfg['run']['cpu_devices']})"
                if jax.default_backend() == "cpu" and cfg["run"]["cpu_devices"] else ""))
    zero = [k for k, v in mesh.items() if v == 0]
    if zero:
        raise ConfigError(f"mesh.{zero[0]}=0 must be a positive size, or mesh.{zero[0]}=-1 to "
                          "use the devices the other axes leave")
    fixed = math.prod(v for v in mesh.values() if v > 0)
    inferred = [k for k, v in mesh.items() if v == -1]
    if not inferred and fixed != n:
        first = next(iter(mesh))
        other = fixed // mesh[first]
        fix = (f"set mesh.{first}={n // other}, " if n % other == 0 else "") + \
            f"set mesh.{first}=-1 to use the devices the other axes leave"
        raise ConfigError(f"{keys} = {fixed} devices, but {where}; {fix}, or change the axes "
                          f"so their product is {n}")
    if inferred and n % fixed:
        raise ConfigError(f"{keys}: mesh.{inferred[0]}=-1 cannot be inferred: {where}, not a "
                          f"multiple of the other axes' product {fixed}; change them so it "
                          f"divides {n}")
    data = mesh["data"] if mesh["data"] > 0 else n // fixed
    check_batch(cfg, data)
    dtype = cfg["plan"].get("compute_dtype")
    if dtype == "float16" and jax.default_backend() == "cpu":
        raise ConfigError(
            "plan.compute_dtype=float16 does not run on the CPU (its XLA has no float16 matmul "
            "with float32 accumulation); use plan.compute_dtype=bfloat16 or float32 (auto "
            "picks float32 here and bfloat16 on GPUs)")


def pretrained_error(directory: str, e: BaseException) -> ConfigError | None:
    """``model.from_pretrained=DIR`` failed on a bad file: an error naming the key, the file and
    what is wrong with it (instead of a raw JSON, codec, errno or SafetensorError text), or
    None when ``e`` already says what to do (e.g. a missing config.json)."""
    import json
    from pathlib import Path

    from fiddlejax.checkpoint.manifest import io_cause

    key = f"model.from_pretrained={directory}"
    if isinstance(e, json.JSONDecodeError | UnicodeDecodeError):
        for name in ("config.json", "model.safetensors.index.json"):
            path = Path(directory) / name
            try:
                if path.is_file():
                    json.loads(path.read_bytes().decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as bad:
                return ConfigError(f"{key}: {name} is damaged ({io_cause(bad)}); restore or "
                                   "re-download it")
        return ConfigError(f"{key}: a JSON file there is damaged ({io_cause(e)})")
    if type(e).__name__ == "SafetensorError":
        bad = _bad_safetensors(Path(directory))
        return ConfigError(f"{key}: {bad or 'a .safetensors file'} is damaged or truncated "
                           "(its header or data does not match its size); restore or "
                           "re-download it")
    if isinstance(e, OSError) and e.errno is not None:
        return ConfigError(f"{key}: cannot read {e.filename or directory} ({io_cause(e)})")
    return None


def _bad_safetensors(directory) -> str | None:
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    f.get_tensor(k)
        except Exception:  # noqa: BLE001 - the first file that fails is the one to name
            return path.name
    return None
