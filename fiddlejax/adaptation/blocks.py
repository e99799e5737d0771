"""The repeated blocks of an unmodified NNX model: found by path, grouped, stacked, unstacked.

:func:`fiddlejax.adaptation.adapt.adapt` names the blocks with a path (a list, an ``nnx.List`` or
numbered attributes); here they are found, checked to hold parameters only, grouped into the
shortest repeating unit when their static attributes differ, and their parameters moved between the
model's own tree and the staged tree that stacks them on a leading layer axis.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax import sharding


def find_blocks(model: nnx.Module, layers: str) -> tuple[tuple[tuple, ...], list]:
    """The state path of each block at ``layers`` and the blocks, in order. Each dotted part
    is an attribute; ``name*`` stands for the numbered attributes ``name0, name1, ...``; a part
    that holds a list stands for each of its elements, so ``'layer*.blocks'`` is every stage's
    blocks, stage after stage."""
    parts = layers.split(".")
    found: list[tuple[tuple, Any]] = [((), model)]
    for k, part in enumerate(parts):
        found = [((*path, name), getattr(m, name))
                 for path, m in found for name in _attributes(m, part)]
        if not found:
            raise ValueError(_not_found(model, ".".join(parts[: k + 1]), layers))
        if k < len(parts) - 1:
            found = [leaf for f in found for leaf in _elements(*f)]
    if (len(found) == 1 and "*" not in layers and isinstance(found[0][1], nnx.Module)
            and not isinstance(found[0][1], nnx.List)):
        raise TypeError(
            f"{type(model).__name__}.{layers} is one module ({type(found[0][1]).__name__}) "
            "whose parameters share no leading layer axis, not a list of blocks nor a stack of "
            "them (nnx.vmap); name the list, or the stacked module, that holds the blocks")
    found = [leaf for f in found for leaf in _elements(*f)]
    bad = [type(b).__name__ for _, b in found if not isinstance(b, nnx.Module)]
    if bad or not found:
        raise TypeError(f"{type(model).__name__}.{layers} must hold nnx.Module blocks (a list, "
                        "an nnx.List or numbered attributes such as 'block_*'); it holds "
                        f"{bad[:4] or 'an empty list'}")
    return tuple(path for path, _ in found), [b for _, b in found]


def _attributes(module: Any, part: str) -> list[str]:
    """The attribute names ``part`` stands for on ``module``: itself, or with a trailing
    ``*`` the numbered ones (``block_*``: ``block_0, block_1, ...``) in numeric order."""
    if not part.endswith("*"):
        return [part] if hasattr(module, part) else []
    numbered = {}
    for name in vars(module):
        m = re.fullmatch(re.escape(part[:-1]) + r"(\d+)", name)
        if m:
            numbered[int(m.group(1))] = name
    return [numbered[i] for i in sorted(numbered)]


def _elements(path: tuple, held: Any) -> list[tuple[tuple, Any]]:
    """``held`` at ``path``, or each element of it (with its index) when it is a list."""
    if isinstance(held, list | tuple | nnx.List):
        return [((*path, i), b) for i, b in enumerate(held)]
    return [(path, held)]


def stacked_at(model: nnx.Module, layers: str) -> tuple[nnx.Module, int] | None:
    """``(module, layer count)`` when ``layers`` names one module whose parameters all share a
    leading axis (blocks stacked with ``nnx.vmap``, applied with a scan); None otherwise."""
    parent = model
    for part in layers.split("."):
        parent = getattr(parent, part, None)
    if not isinstance(parent, nnx.Module) or isinstance(parent, nnx.List):
        return None
    params = jax.tree.leaves(nnx.state(parent, nnx.Param))
    sizes = {np.shape(p)[0] if np.ndim(p) else None for p in params}
    return (parent, sizes.pop()) if len(sizes) == 1 and None not in sizes else None


def _not_found(model, what: str, layers: str) -> str:
    attrs = sorted(k for k, v in vars(model).items()
                   if isinstance(v, nnx.Module | list | tuple) and not k.startswith("_"))
    return (f"layers={layers!r}: {type(model).__name__} has no {what!r}; its submodules are "
            f"{attrs}. Name the attribute path of the repeated blocks, e.g. layers='decoder."
            "blocks', 'decoder.block_*' for numbered attributes, or 'stage*.blocks' for the "
            "blocks of every stage")


def static_diff(a: Any, b: Any, path: str = "") -> str | None:
    """The first static attribute (path and both values) in which two blocks differ."""
    return next((d for d, _ in static_diffs(a, b, path)), None)


def static_diffs(a: Any, b: Any, path: str = "", owner: Any = None) -> list[tuple[str, tuple]]:
    """Every static difference between two blocks: (what differs, the attribute's path when it
    is a plain value that no method of its module but ``__init__`` mentions, else ``()``)."""
    if isinstance(a, nnx.Module) and isinstance(b, nnx.Module):
        if type(a) is not type(b):
            return [(f"{path or 'the block'} is {type(a).__name__} vs {type(b).__name__}", ())]
        out = []
        for k in sorted(set(vars(a)) | set(vars(b))):
            if k.startswith("_"):
                continue
            va, vb = vars(a).get(k), vars(b).get(k)
            if isinstance(va, nnx.Variable) or isinstance(vb, nnx.Variable):
                found = _variable_diff(va, vb, f"{path}{k}")
                out += [(found, ())] if found else []
            else:
                out += static_diffs(va, vb, f"{path}{k}.", a)
        return out
    if isinstance(a, list | tuple | nnx.List) and isinstance(b, list | tuple | nnx.List):
        if len(a) != len(b):
            return [(f"{path[:-1]} has {len(a)} vs {len(b)} entries", ())]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in static_diffs(x, y, f"{path}{i}.")]
    try:
        same = bool(a == b)
    except Exception:  # arrays and the like: not static
        same = True
    if same:
        return []
    name = path[:-1].rsplit(".", 1)[-1]
    plain = all(isinstance(v, int | float | str | bool | None) for v in (a, b))
    inert = owner is not None and plain and name not in _mentioned(type(owner))
    return [(f"{path[:-1]} = {a!r} vs {b!r}", tuple(path[:-1].split(".")) if inert else ())]


_BASES = ("flax.nnx.module", "flax.nnx.pytree", "flax.nnx.object", "builtins")


@functools.cache
def _mentioned(cls: type) -> frozenset[str]:
    """Every attribute name (and string) in the methods of ``cls`` but ``__init__``, over its
    bases: an attribute named nowhere is presumed unread (checked when the forward is traced).
    A class without source mentions everything."""
    names: set[str] = set()
    for c in cls.__mro__:
        if c.__module__ in _BASES:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(c)))
        except (OSError, TypeError, SyntaxError):
            return _EVERYTHING
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name != "__init__":
                for n in ast.walk(node):
                    if isinstance(n, ast.Attribute):
                        names.add(n.attr)
                    elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                        names.add(n.value)
    return frozenset(names)


class _Everything(frozenset):
    def __contains__(self, item: object) -> bool:
        return True


_EVERYTHING = _Everything()


def watch(block: nnx.Module, ignored: tuple, hits: list) -> None:
    """Note in ``hits`` each ignored attribute (a path below ``block``) the forward reads: its
    module's class becomes a subclass that records the reads."""
    for path in ignored:
        module = block
        for part in path[:-1]:
            module = module[int(part)] if part.isdigit() else getattr(module, part, None)
        if not isinstance(module, nnx.Module) or path[-1] not in vars(module):
            continue  # another block of a unit
        cls = type(module)
        names = getattr(cls, "_fiddlejax_watched", None)
        base = cls.__bases__[0] if names is not None else cls
        watched = _watcher(base, frozenset((names or set()) | {path[-1]}))
        object.__setattr__(module, "__class__", watched)
        object.__setattr__(module, "_fiddlejax_hits", (hits, path[:-1]))


@functools.cache
def _watcher(cls: type, names: frozenset) -> type:
    def __getattribute__(self, name):  # noqa: N807
        if name in names:
            hits, at = object.__getattribute__(self, "_fiddlejax_hits")
            hits.append(".".join((*at, name)))
        return cls.__getattribute__(self, name)

    return type(cls)(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                            "_fiddlejax_watched": names,
                                            "__module__": cls.__module__})


def _variable_diff(va: Any, vb: Any, where: str) -> str | None:
    """How two variables differ in shape or metadata (their values may differ freely)."""
    if np.shape(va) != np.shape(vb):
        return f"{where} has shape {np.shape(va)} vs {np.shape(vb)}"
    ma, mb = (v.get_metadata() if isinstance(v, nnx.Variable) else {} for v in (va, vb))
    if ma != mb:
        key = next(m for m in sorted(set(ma) | set(mb)) if ma.get(m) != mb.get(m))
        return f"{where} metadata {key}={ma.get(key)!r} vs {mb.get(key)!r}"
    return None


def repeating_unit(model: nnx.Module, layers: str, blocks: list,
                   unequal: bool = False) -> tuple[int, tuple]:
    """The shortest period ``k`` (dividing the block count) after which blocks repeat, and the
    attributes (paths below a block) ignored in that comparison: plain values that differ
    between blocks but that no method besides ``__init__`` names (Mamba2's ``layer_idx``).
    Each block then runs with its unit's first value; the first trace checks none is read.
    ``unequal``: blocks that repeat in no pattern give ``k`` = their count (each its own kind:
    :mod:`fiddlejax.adaptation.hetero`) instead of an error."""
    defs = [nnx.split(b)[0] for b in blocks]
    n = len(blocks)
    ignored: dict[tuple, str] = {}

    def same(i: int, j: int) -> bool:
        if defs[i] == defs[j]:
            return True
        diffs = static_diffs(blocks[j], blocks[i])
        if not all(path for _, path in diffs):
            return False
        ignored.update({path: d for d, path in diffs})
        return True

    for k in range(1, n + 1):
        ignored.clear()
        if n % k == 0 and all(same(i, i % k) for i in range(n)):
            break
    name = f"{type(model).__name__}.{layers}"
    if k > 1:
        j = next(i for i in range(1, n) if defs[i] != defs[0])
        diff = static_diff(blocks[0], blocks[j]) or "their structure"
        if k == n and unequal:
            return n, ()
        if k == n:
            raise ValueError(
                f"{name}: block {j} differs from block 0 in {diff}, and the {n} blocks repeat "
                f"in no pattern that divides {n}; fiddlejax stacks identical blocks (or a "
                "repeating unit of them). Make the blocks identical (an attribute that differs "
                "only as a label can be set equal before parallelize; attributes that no "
                "method besides __init__ names are ignored), or a whole number of repeats of a "
                "unit")
        warnings.warn(f"{name}: blocks differ in {diff}; stacking units of {k} blocks "
                      f"({n // k} units: a pipeline cuts between units)",
                      stacklevel=sharding.user_stacklevel())
    if ignored:
        warnings.warn(
            f"{name}: blocks differ in {sorted(ignored.values())}, which no method besides "
            "__init__ reads; ignored (every block runs with its unit's first value, and the "
            "first step checks that the forward never reads them)",
            stacklevel=sharding.user_stacklevel())
    return k, tuple(sorted(ignored))


def refuse_reads(where: str, hits: list) -> None:
    """Refuse a forward that read an attribute :func:`repeating_unit` ignored."""
    if hits:
        raise ValueError(
            f"{where}: the forward reads {sorted(set(hits))}, which differs between blocks; "
            "fiddlejax stacks identical blocks. Make it equal across the blocks before "
            "parallelize if the training forward does not depend on it (a label, a cache "
            "index), or group the blocks into identical ones")


FROZEN = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))  # statistics, buffers: read, not trained


def check_frozen(model: nnx.Module, layers: str) -> None:
    """Refuse batch statistics in training mode anywhere in the model: a layout computes them
    per microbatch and data shard, so no split reproduces the whole batch's."""
    for path, m in nnx.iter_graph(model):
        if isinstance(m, nnx.BatchNorm) and not m.use_running_average:
            where = "".join(f"[{p!r}]" for p in path)
            raise ValueError(
                f"{type(model).__name__}{where} ({layers=}) is non-parameter state the forward "
                "updates: BatchNorm(use_running_average=False), batch statistics in training "
                "mode, which fiddlejax would compute per microbatch and data shard. Train with "
                "frozen statistics (model.set_attributes(use_running_average=True)), or use "
                "LayerNorm or GroupNorm")


def block_constants(blocks: list, unit: int, scanned: bool = False) -> tuple[nnx.State, ...]:
    """Per block of a unit: the blocks' non-parameter state (frozen statistics, buffers)
    stacked over the units, so that each block runs with its own (index by the unit)."""
    if scanned:
        return (nnx.state(blocks[0], FROZEN),)
    return tuple(jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]),
                              *[nnx.state(b, FROZEN) for b in blocks[j::unit]])
                 for j in range(unit))


def check_unwritten(where: str, before: list, after: list) -> None:
    """Refuse a forward that wrote the blocks' non-parameter state (carried as constants)."""
    def same(x, y) -> bool:  # ``before`` holds concrete values; a write would be traced
        return x is y or (not isinstance(y, jax.core.Tracer) and np.array_equal(x, y))

    if not all(same(x, y) for b, a in zip(before, after, strict=True)
               for x, y in zip(b, a, strict=True)):
        raise ValueError(
            f"{where}: the forward updates the blocks' non-parameter state (statistics in "
            "training mode, a cache?); fiddlejax carries that state as per-block constants. "
            "Freeze it for training (e.g. model.set_attributes(use_running_average=True)), or "
            "keep it out of the blocks")


# -- the canonical tree (the model's own) <-> the staged tree (blocks stacked) ----------------
def stack_params(params: nnx.State, template: nnx.State, keys: tuple, unit: int, stack: str,
                 owner: str, scanned: bool = False) -> nnx.State:
    """``params`` (the model's tree) with the blocks stacked under ``stack``; every leaf takes
    the variable type and sharding names of ``template`` (so params without metadata, e.g.
    restored ones, are laid out as the trainer planned). ``owner`` names the model in errors.
    ``scanned``: ``keys`` is one module already stacked (``nnx.vmap``): it moves as it is."""
    values = {p: _value(v) for p, v in nnx.to_flat_state(params)}
    flat_template = list(nnx.to_flat_state(template))
    missing = [p for p, _ in flat_template if p not in values]
    if missing:
        raise ValueError(f"params lack {'/'.join(map(str, missing[0]))} of "
                         f"{owner}'s parameter tree")
    outer, blocks = [], {}
    for path, t in flat_template:
        i = _block_index(keys, path)
        if i is None:
            outer.append((path, _with_value(t, values[path])))
        else:
            u, j = divmod(i, unit)
            sub = path[len(keys[i]):]
            blocks.setdefault((j, sub), [t, []])[1].append(values[path])
    stacked = []
    for (j, sub), (t, vals) in blocks.items():
        key = (stack, j, *sub) if unit > 1 else (stack, *sub)
        value = vals[0] if scanned else jnp.stack(vals)
        stacked.append((key, _with_value(t, value, stacked=not scanned)))
    return nnx.from_flat_state(outer + stacked)


def unstack_params(params: nnx.State, template: nnx.State, keys: tuple, unit: int,
                   stack: str, scanned: bool = False) -> nnx.State:
    """The inverse of :func:`stack_params`: blocks unstacked into the model's own tree."""
    flat = dict(nnx.to_flat_state(params))
    out = []
    for path, t in dict(nnx.to_flat_state(template)).items():
        i = _block_index(keys, path)
        if i is None:
            out.append((path, _with_value(t, _value(flat[path]))))
            continue
        sub = path[len(keys[i]):]
        u, j = divmod(i, unit)
        key = (stack, j, *sub) if unit > 1 else (stack, *sub)
        value = _value(flat[key])
        out.append((path, _with_value(t, value if scanned else value[u])))
    return nnx.from_flat_state(out)


def _block_index(keys: tuple, path: tuple) -> int | None:
    for i, key in enumerate(keys):
        if path[: len(key)] == key:
            return i
    return None


def _value(v):
    return v.get_value() if isinstance(v, nnx.Variable) else v


def _with_value(v, value, stacked: bool = False):
    """``v`` (a Variable, or a raw leaf) holding ``value``; a stacked one gains the "layers"
    sharding name in front of its own (or none, when unannotated)."""
    if not isinstance(v, nnx.Variable):
        return value
    names = v.get_metadata().get("out_sharding")
    if stacked and names:
        return v.replace(value, out_sharding=("layers", *names))
    return v.replace(value)
