"""What a checkpoint records about its arrays, and the checks a restore runs against the record.

Every array of the canonical state is named by its tree path (``params.blocks.w1``) and recorded
with its shape, dtype and a layout-independent fingerprint. A restore compares names, shapes and
dtypes with the target before reading any array, and fingerprints after, so a different model or
a corrupted checkpoint fails with an error naming the array instead of training on garbage.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = 1  # bump when the layout of a step directory changes


# -- naming --------------------------------------------------------------------------------------
def _segment(key) -> str | None:
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return None if key.name == "value" else key.name  # nnx.Variable's payload: not a level
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def named_leaves(tree) -> tuple[list[tuple[str, ...]], list, Any]:
    """(path segments, leaves, treedef) of ``tree``, paths as strings without Variable levels."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [tuple(s for s in map(_segment, p) if s is not None) for p, _ in flat]
    return paths, [x for _, x in flat], treedef


def nest(paths: list[tuple[str, ...]], leaves: list) -> dict:
    """Leaves as nested dicts keyed by path segment: the tree Orbax writes and reads."""
    out: dict = {}
    for path, leaf in zip(paths, leaves):
        d = out
        for s in path[:-1]:
            d = d.setdefault(s, {})
        d[path[-1]] = leaf
    return out


def lookup(tree: dict, path: tuple[str, ...]):
    """The leaf of :func:`nest`'s ``tree`` at ``path``."""
    for s in path:
        tree = tree[s]
    return tree


def array_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


# -- fingerprints --------------------------------------------------------------------------------
def _fingerprint(x: jax.Array) -> jax.Array:
    """A position-weighted sum of the bits of ``x`` mod 2**32.

    Integer addition is associative, so every layout and reduction order gives the same value;
    any single changed element changes it (the weights are odd).
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
        stride = stride * x.shape[d] % 2**32
    weights = index * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * (weights | jnp.uint32(1)), dtype=jnp.uint32)


# Leaf by leaf, not one program over every leaf: XLA's CPU backend materialises each leaf's
# uint32 index and weights, and one program holds them for every leaf at once (2.3x the
# state's bytes of temporaries: the peak of a zero=3 job's save, 25x its checkpoint's bytes).
# One leaf at a time holds at most the largest leaf's; the values are the same integers.
@jax.jit
def _summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    bad = (jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) if jnp.issubdtype(x.dtype, jnp.inexact)
           else jnp.zeros((), jnp.int32))
    return _fingerprint(x), bad


def _summaries(leaves: list) -> list[tuple[int, int]]:
    """``(fingerprint, NaN/inf count)`` of each leaf, each finished before the next starts."""
    return [tuple(int(v) for v in jax.device_get(_summary(x))) for x in leaves]


def fingerprints(leaves: list) -> np.ndarray:
    """Every leaf's fingerprint (uint32)."""
    return np.array([f for f, _ in _summaries(leaves)], np.uint32)


def save_summaries(leaves: list) -> tuple[np.ndarray, np.ndarray]:
    """Every leaf's fingerprint and its count of NaN/inf elements (a save reads the
    fingerprints anyway; the finiteness test rides along)."""
    both = _summaries(leaves)
    return (np.array([f for f, _ in both], np.uint32), np.array([b for _, b in both], np.int32))


def compile_summaries(leaves: list, lowered: Any = None) -> None:
    """Compile :func:`save_summaries` for ``leaves`` (arrays or ShapeDtypeStructs with their
    shardings), and ``lowered`` (the conversion that makes them), without running them."""
    if lowered is not None:
        lowered.compile()
    seen = set()
    for x in leaves:
        key = (x.shape, x.dtype, getattr(x, "sharding", None))
        if key not in seen:
            seen.add(key)
            _summary.lower(x).compile()


def first_nonfinite(paths, leaves, bad: np.ndarray) -> str | None:
    """``"<name> holds k NaN/inf values (of n)"`` for the first array that has any, else None."""
    for p, x, k in zip(paths, leaves, bad):
        if int(k):
            return f"{array_name(p)} holds {int(k)} NaN/inf values (of {x.size})"
    return None


# -- the record ----------------------------------------------------------------------------------
def array_records(paths, leaves, fps) -> dict:
    """``{name: {"shape", "dtype", "fingerprint"}}``: the ``arrays`` entry of a step's meta."""
    return {array_name(p): {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name,
                            "fingerprint": int(f)}
            for p, x, f in zip(paths, leaves, fps)}


def rng_record(rng: jax.Array | None) -> dict | None:
    """A PRNG key (typed or raw ``uint32``) as JSON; :func:`rng_from_record` inverts it."""
    if rng is None:
        return None
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(rng) if typed else rng
    return {"typed": bool(typed), "data": np.asarray(data).tolist(),
            "impl": str(jax.random.key_impl(rng)) if typed else None}


def rng_from_record(meta: dict | None):
    if meta is None:
        return None
    data = jnp.asarray(np.asarray(meta["data"], np.uint32))
    return jax.random.wrap_key_data(data, impl=meta["impl"]) if meta["typed"] else data


def jsonable(x: Any) -> Any:
    """``x`` with numpy/JAX scalars and arrays turned into plain Python for JSON."""
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic | np.ndarray | jax.Array):
        return np.asarray(x).tolist()
    return str(x)


# -- the checks ----------------------------------------------------------------------------------
def check_compatible(where: str, meta: dict, model: str, paths, target) -> None:
    """Raise ``ValueError`` listing how the saved arrays differ from ``target``'s (up to five)."""
    if meta.get("model") != model:
        raise ValueError(f"{where} holds a {meta.get('model')} model but the trainer's is "
                         f"{model}; restore it with a trainer for {meta.get('model')}")
    saved = meta["arrays"]
    ours = {array_name(p): x for p, x in zip(paths, target)}
    problems = []
    for name, x in ours.items():
        s = saved.get(name)
        if s is None:
            problems.append(f"the model has {name} {tuple(x.shape)} but the checkpoint "
                            "does not")
        elif tuple(s["shape"]) != tuple(x.shape):
            problems.append(f"checkpoint has {name} of shape {tuple(s['shape'])} but the "
                            f"model has {tuple(x.shape)}")
        elif s["dtype"] != np.dtype(x.dtype).name:
            problems.append(f"checkpoint has {name} as {s['dtype']} but the model has "
                            f"{np.dtype(x.dtype).name}")
    problems += [f"checkpoint has {n} {tuple(saved[n]['shape'])} but the model does not"
                 for n in saved if n not in ours]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        params = any(" params." in p for p in problems)
        hint = "a different model or config" if params else "a different optimizer"
        raise ValueError(f"{where} does not fit this trainer ({hint}?): "
                         + "; ".join(problems[:5]) + more)


def first_mismatch(meta: dict, paths, leaves) -> tuple[str, int, int] | None:
    """``(name, got, recorded)`` of the first array whose fingerprint changed, or None."""
    fps = np.asarray(fingerprints(leaves))
    for p, got in zip(paths, fps):
        want = meta["arrays"][array_name(p)]["fingerprint"]
        if int(got) != want:
            return array_name(p), int(got), want
    return None


# -- errors from the storage layer, as a user reads them ----------------------------------------
_ERRNO_FIX = {errno.ENOSPC: "the disk is full", errno.EFBIG: "a file size limit (ulimit -f?)",
              errno.EDQUOT: "the disk quota is used up", errno.EROFS: "the disk is read-only",
              errno.EACCES: "no permission to write there", errno.EIO: "the disk failed"}


def io_cause(e: BaseException) -> str:
    """Why a read or write failed, without TensorStore's or Orbax's internals: the operating
    system's reason when there is one (``[os_error_code='27']`` -> "File too large")."""
    import json

    if isinstance(e, json.JSONDecodeError):
        return f"its JSON is cut off or damaged at line {e.lineno}, column {e.colno}"
    if isinstance(e, UnicodeDecodeError):
        return f"it holds bytes that are not {e.encoding} text (at byte {e.start})"
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e:  # the storage layer's own error is the innermost
        return io_cause(cause)
    text = str(e)
    if "is not valid for value of size" in text:
        return "a data file is shorter than the checkpoint recorded (truncated: a copy cut short?)"
    if "checksum" in text.lower() or "DATA_LOSS" in text:
        return "a data file does not match its checksum: damaged on disk or in a copy"
    code = getattr(e, "errno", None)
    m = re.search(r"os_error_code='?(\d+)", text)
    if m:
        code = int(m.group(1))
    if isinstance(code, int) and code in errno.errorcode:
        fix = _ERRNO_FIX.get(code)
        return f"{os.strerror(code)}" + (f": {fix}" if fix else "")
    line = (text.strip().splitlines() or [type(e).__name__])[0]
    return line.split(" See full TensorStore details")[0][:200]
