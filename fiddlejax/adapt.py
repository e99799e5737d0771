"""An ordinary Flax NNX model as a :class:`~fiddlejax.staged.StagedModel`, its code untouched.

``fj.parallelize(model, optimizer, plan, layers="decoder.blocks", loss=loss_fn)`` names where the
repeated blocks live: a Python list or tuple, an ``nnx.List``, or numbered attributes
(``"decoder.block_*"`` for ``block_0``, ``block_1``...). From that alone:

- the blocks' parameters are stacked on a leading layer axis (under the key ``layers``, the
  path itself) and unstacked again for the canonical tree, so ``trainer.params(state)``,
  gradients and checkpoints keep the model's own ``nnx.state(model, nnx.Param)``
  (:meth:`AdaptedModel.to_staged` and :meth:`AdaptedModel.to_model`);
- the model's own ``__call__`` is split around the blocks: the blocks are replaced by stand-ins
  that stop the forward at the first block (the prologue) or feed the stack's output to what
  follows the last block (the epilogue), so no part of the model's code is copied;
- side inputs the blocks receive (masks, positions, segment ids, rotary tables: whatever
  arrays ``__call__`` passes besides the activation) travel with the activation: the message
  between layers and stages is one ``[batch, features]`` array packing the activation and the
  side inputs, which each layer unpacks (side inputs get no gradient);
- blocks that differ in static attributes (local and global attention...) are grouped into the
  shortest repeating unit (5 local + 1 global: units of 6 blocks), or refused with an error that
  names the differing attribute.

The model is called with the batch entries named like parameters of its ``__call__`` (plus
``tokens[:, :-1]`` first for a next-token batch of ``tokens``), and with None for a required
parameter typed optional that the batch lacks (``cache: Cache | None``: a training forward has no
KV cache); the loss gets its outputs and the whole batch. One shapes-only trace per batch shape
checks that the split is faithful: each block called once, in order, back to back, every block
given the same side inputs, and no side input computed from the parameters. Anything else is an
error naming the model, the blocks and the fix, never a traceback from inside tracing.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import math
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax import sharding
from fiddlejax.staged import Loss, StagedModel, as_weighted, check_dropout, unpad_outputs

# What the stand-ins do in the current trace: ("prologue",), ("epilogue", x) or
# ("record", blocks, log).
_MODE: contextvars.ContextVar = contextvars.ContextVar("fiddlejax_adapt_mode", default=None)


class _Stop(Exception):  # noqa: N818 -- control flow, not an error
    def __init__(self, args, kwargs):
        self.args_, self.kwargs_ = args, kwargs


class _StandIn:
    """Takes block ``i``'s place inside the model while its forward is split."""

    def __init__(self, i: int):
        self.i = i

    def __eq__(self, other):
        return isinstance(other, _StandIn) and other.i == self.i

    def __hash__(self):
        return hash(("fiddlejax-block", self.i))

    def __repr__(self):
        return f"<fiddlejax block {self.i}>"

    def __call__(self, *args, **kwargs):
        mode = _MODE.get()
        if mode is None:
            raise RuntimeError("a fiddlejax stand-in block was called outside fiddlejax")
        if mode[0] == "prologue":
            raise _Stop(args, kwargs)
        if mode[0] == "epilogue":  # the stack's output, in the structure a block returns
            return jax.tree.unflatten(mode[2], [mode[1] if self.i == 0 else args[0]])
        _, blocks, log = mode  # record: run the real block and note what it got
        out = blocks[self.i](*args, **kwargs)
        log.append((self.i, args, kwargs, out))
        return out


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True)
class _Side:
    """How the side inputs of a block call are rebuilt from the packed message."""

    treedef: Any                 # of (args[1:], kwargs) with array leaves as None placeholders
    statics: tuple               # the non-array leaves, in order (None where an array goes)
    shapes: tuple                # per-example shapes of the array leaves
    dtypes: tuple
    x_shape: tuple               # per-example shape of the activation
    x_dtype: Any


def _block_paths(model: nnx.Module, layers: str) -> tuple[Any, str, list[str | int], list]:
    """(parent module, attribute, state keys of the blocks, the blocks) for ``layers``."""
    parts = layers.split(".")
    parent = model
    for k, part in enumerate(parts[:-1]):
        if not hasattr(parent, part):
            raise ValueError(_not_found(model, ".".join(parts[: k + 1]), layers))
        parent = getattr(parent, part)
    last = parts[-1]
    if last.endswith("*"):
        prefix = last[:-1]
        found = {}
        for name in vars(parent):
            m = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
            if m:
                found[int(m.group(1))] = name
        if not found:
            raise ValueError(_not_found(model, layers, layers))
        names = [found[i] for i in sorted(found)]
        return parent, last, names, [getattr(parent, n) for n in names]
    if not hasattr(parent, last):
        raise ValueError(_not_found(model, layers, layers))
    held = getattr(parent, last)
    if isinstance(held, list | tuple | nnx.List):
        blocks = list(held)
        if not blocks or not all(isinstance(b, nnx.Module) for b in blocks):
            raise TypeError(f"{type(model).__name__}.{layers} must hold nnx.Module blocks; it "
                            f"holds {[type(b).__name__ for b in blocks][:4]}")
        return parent, last, list(range(len(blocks))), blocks
    if isinstance(held, nnx.Module):
        raise TypeError(
            f"{type(model).__name__}.{layers} is one module ({type(held).__name__}), not a list "
            "of blocks: for blocks already stacked with nnx.vmap, declare the explicit staged "
            "protocol (stack, prologue, head, loss; see fiddlejax.staged); else name the list "
            "that holds the blocks")
    raise TypeError(f"{type(model).__name__}.{layers} is a {type(held).__name__}; name a list, "
                    "an nnx.List or numbered attributes ('block_*') holding the blocks")


def _not_found(model, what: str, layers: str) -> str:
    attrs = sorted(k for k, v in vars(model).items()
                   if isinstance(v, nnx.Module | list | tuple) and not k.startswith("_"))
    return (f"layers={layers!r}: {type(model).__name__} has no {what!r}; its submodules are "
            f"{attrs}. Name the attribute path of the repeated blocks, e.g. layers='decoder."
            "blocks', or 'decoder.block_*' for numbered attributes")


def _static_diff(a: Any, b: Any, path: str = "") -> str | None:
    """The first static attribute (path and both values) in which two blocks differ."""
    if isinstance(a, nnx.Module) and isinstance(b, nnx.Module):
        if type(a) is not type(b):
            return f"{path or 'the block'} is {type(a).__name__} vs {type(b).__name__}"
        for k in sorted(set(vars(a)) | set(vars(b))):
            if k.startswith("_"):
                continue
            va, vb = vars(a).get(k), vars(b).get(k)
            if isinstance(va, nnx.Variable) or isinstance(vb, nnx.Variable):
                if np.shape(va) != np.shape(vb):
                    return f"{path}{k} has shape {np.shape(va)} vs {np.shape(vb)}"
                ma, mb = (v.get_metadata() if isinstance(v, nnx.Variable) else {}
                          for v in (va, vb))
                if ma != mb:
                    key = next(m for m in sorted(set(ma) | set(mb)) if ma.get(m) != mb.get(m))
                    return f"{path}{k} metadata {key}={ma.get(key)!r} vs {mb.get(key)!r}"
                continue
            found = _static_diff(va, vb, f"{path}{k}.")
            if found:
                return found
        return None
    if isinstance(a, list | tuple | nnx.List) and isinstance(b, list | tuple | nnx.List):
        if len(a) != len(b):
            return f"{path[:-1]} has {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _static_diff(x, y, f"{path}{i}.")
            if found:
                return found
        return None
    try:
        same = bool(a == b)
    except Exception:  # arrays and the like: not static
        same = True
    return None if same else f"{path[:-1]} = {a!r} vs {b!r}"


def _unit(model: nnx.Module, layers: str, blocks: list) -> int:
    """The shortest period ``k`` (dividing the block count) after which blocks repeat."""
    defs = [nnx.split(b)[0] for b in blocks]
    n = len(blocks)
    for k in range(1, n + 1):
        if n % k == 0 and all(defs[i] == defs[i % k] for i in range(n)):
            break
    if k > 1:
        j = next(i for i in range(1, n) if defs[i] != defs[0])
        diff = _static_diff(blocks[0], blocks[j]) or "their structure"
        if k == n:
            raise ValueError(
                f"{type(model).__name__}.{layers}: block {j} differs from block 0 in {diff}, "
                f"and the {n} blocks repeat in no pattern that divides {n}; fiddlejax stacks "
                "identical blocks (or a repeating unit of them). Make the blocks identical, or "
                "a whole number of repeats of a unit")
        warnings.warn(
            f"{type(model).__name__}.{layers}: blocks differ in {diff}; stacking units of {k} "
            f"blocks ({n // k} units: a pipeline cuts between units)", stacklevel=4)
    return k


def _bad_state(model: nnx.Module, blocks: list, layers: str) -> None:
    for i, b in enumerate(blocks):
        other = nnx.state(b, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
        leaves = jax.tree_util.tree_flatten_with_path(other)[0]
        if leaves:
            path = jax.tree_util.keystr(leaves[0][0])
            raise ValueError(
                f"{type(model).__name__}.{layers}[{i}]{path} is non-parameter state (batch "
                "statistics, a cache?); fiddlejax trains blocks whose only state is nnx.Param")


@dataclasses.dataclass(frozen=True)
class AdaptedModel(StagedModel):
    """A :class:`StagedModel` of an unmodified NNX model (build with :func:`adapt`)."""

    unit: int = 1                      # blocks per stacked layer
    unit_graphdefs: tuple = ()         # graph definitions of a unit's blocks
    unit_rest: tuple = ()              # their non-parameter state (rate-0 RNG streams)
    block_keys: tuple = ()             # state paths of the blocks in the model's tree
    template: Any = None               # the model's canonical parameters (shapes, metadata)
    sides: dict = dataclasses.field(default_factory=dict)  # message width -> _Side
    callsite: str = ""
    call_names: tuple = ()             # parameter names of the model's __call__, in order
    call_nones: frozenset = frozenset()  # required ones typed optional: None if not given
    checked: dict = dataclasses.field(default_factory=dict)  # batch shapes -> block output def

    # -- the canonical tree (the model's own) <-> the staged tree (blocks stacked) -----------
    def to_staged(self, params: nnx.State) -> nnx.State:
        """The model's parameter tree with the blocks stacked under ``self.stack``; every leaf
        takes the variable type and sharding names of the canonical template (so params
        without metadata, e.g. restored ones, are laid out as the trainer planned)."""
        values = {p: _value(v) for p, v in nnx.to_flat_state(params)}
        template = list(nnx.to_flat_state(self.template))
        missing = [p for p, _ in template if p not in values]
        if missing:
            raise ValueError(f"params lack {'/'.join(map(str, missing[0]))} of "
                             f"{self.callsite.split('.')[0]}'s parameter tree")
        outer, blocks = [], {}
        for path, t in template:
            i = self._block_index(path)
            if i is None:
                outer.append((path, _with_value(t, values[path])))
            else:
                u, j = divmod(i, self.unit)
                sub = path[len(self.block_keys[i]):]
                blocks.setdefault((j, sub), [t, []])[1].append(values[path])
        stacked = []
        for (j, sub), (t, vals) in blocks.items():
            key = (self.stack, j, *sub) if self.unit > 1 else (self.stack, *sub)
            stacked.append((key, _with_value(t, jnp.stack(vals), stacked=True)))
        return nnx.from_flat_state(outer + stacked)

    def to_model(self, params: nnx.State) -> nnx.State:
        """The inverse of :meth:`to_staged`: blocks unstacked into the model's own tree."""
        flat = dict(nnx.to_flat_state(params))
        template = dict(nnx.to_flat_state(self.template))
        out = []
        for path, t in template.items():
            i = self._block_index(path)
            if i is None:
                out.append((path, _with_value(t, _value(flat[path]))))
                continue
            sub = path[len(self.block_keys[i]):]
            u, j = divmod(i, self.unit)
            key = (self.stack, j, *sub) if self.unit > 1 else (self.stack, *sub)
            out.append((path, _with_value(t, _value(flat[key])[u])))
        return nnx.from_flat_state(out)

    def _block_index(self, path: tuple) -> int | None:
        for i, key in enumerate(self.block_keys):
            if path[: len(key)] == key:
                return i
        return None

    # -- the forward, split around the blocks ------------------------------------------------
    def _outer(self, params: nnx.State) -> nnx.Module:
        outer = nnx.State({k: v for k, v in params.items() if k != self.stack})
        return nnx.merge(self.graphdef, outer, self.rest, copy=True)

    def _call(self, model: nnx.Module, batch: dict) -> Any:
        """The model on a batch: ``tokens[:, :-1]`` for next-token batches, and every batch
        entry named like a parameter of ``__call__`` as that keyword (None for the required
        optional ones the batch lacks, as a training script passes ``cache=None``)."""
        kwargs = {k: v for k, v in batch.items() if k in self.call_names and k != "tokens"}
        skip = set(batch) | (set(self.call_names[:1]) if "tokens" in batch else set())
        defaults = {k: None for k in self.call_nones - skip}
        if "tokens" in batch:
            return model(batch["tokens"][:, :-1], **defaults, **kwargs)
        if kwargs:
            return model(**defaults, **kwargs)
        raise KeyError(
            f"the batch has keys {sorted(batch)}, none of them a parameter of "
            f"{self.callsite.split('.')[0]}.__call__ {sorted(self.call_names)}: fiddlejax calls "
            "an adapted model with the batch entries named like its parameters (or with "
            "tokens[:, :-1] for a batch of 'tokens'); rename the batch keys")

    def prologue(self, params: nnx.State, batch: dict) -> jax.Array:
        """Runs the model's ``__call__`` up to its first block: the packed message."""
        if _shape_key(batch) not in self.checked:
            self._check_split(params, batch)
        args, kwargs = self._first_call(self._outer(params), batch)
        return self._pack(args[0], args[1:], kwargs)

    def _first_call(self, model: nnx.Module, batch: dict) -> tuple[tuple, dict]:
        token = _MODE.set(("prologue",))
        try:
            self._call(model, batch)
        except _Stop as stop:
            return stop.args_, stop.kwargs_
        finally:
            _MODE.reset(token)
        raise ValueError(f"{self.callsite}: the model's __call__ never called these blocks; "
                         "name the blocks that __call__ runs")

    def layer(self, layer_params: nnx.State, x: jax.Array) -> jax.Array:
        """One stacked unit of blocks on the packed message."""
        side = self.sides[x.shape[1:]]
        h, args, kwargs = self._unpack(x, side)
        for j, gd in enumerate(self.unit_graphdefs):
            p = layer_params[j] if self.unit > 1 else layer_params
            block = nnx.merge(gd, p, self.unit_rest[j], copy=True)
            h = _activation(block(h, *args, **kwargs))
        n = math.prod(side.x_shape)
        return x.at[:, :n].set(h.reshape(h.shape[0], n).astype(x.dtype))

    def weighted_loss(self, params: nnx.State, x: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
        """Runs the model's ``__call__`` after its blocks on the stack's output, then the loss."""
        side = self.sides[x.shape[1:]]
        h, _, _ = self._unpack(x, side)
        token = _MODE.set(("epilogue", h, self.checked[_shape_key(batch)]))
        try:
            outputs = self._call(self._outer(params), batch)
        finally:
            _MODE.reset(token)
        outputs = unpad_outputs(outputs, self.vocab_pads)
        return as_weighted(self.loss_fn(outputs, batch), self.loss_fn)

    # -- checks, once per batch shape: the forward splits as assumed --------------------------
    def _check_split(self, params: nnx.State, batch: dict) -> None:
        """Trace the whole forward once (shapes only) with the real blocks and check that it
        calls them once each, in order, back to back, with the same side inputs, and that the
        side inputs do not depend on the parameters (they get no gradient)."""
        outer = _abstract(nnx.State({k: v for k, v in params.items() if k != self.stack}))
        flat = dict(nnx.to_flat_state(self.template))
        blocks = [nnx.from_flat_state([(p[len(key):], _abstract(v)) for p, v in flat.items()
                                       if p[: len(key)] == key]) for key in self.block_keys]
        b = _abstract(batch)
        info = {}

        def record(o, bps, bt):
            model = nnx.merge(self.graphdef, o, self.rest, copy=True)
            real = [nnx.merge(self.unit_graphdefs[i % self.unit], bp,
                              self.unit_rest[i % self.unit], copy=True)
                    for i, bp in enumerate(bps)]
            log = []
            token = _MODE.set(("record", real, log))
            try:
                self._call(model, bt)
            finally:
                _MODE.reset(token)
            info["out"] = self._check_log(log)

        jax.eval_shape(record, outer, blocks, b)

        def side_inputs(o, bt):
            args, kwargs = self._first_call(nnx.merge(self.graphdef, o, self.rest, copy=True), bt)
            return [a for a in jax.tree.leaves((args[1:], kwargs)) if isinstance(a, jax.Array)]

        closed = jax.make_jaxpr(side_inputs)(outer, b)
        if any(_depends(closed.jaxpr, len(jax.tree.leaves(outer)))):
            raise ValueError(
                f"{self.callsite}: a side input the blocks receive is computed from the "
                "parameters (an encoder output for cross-attention?); fiddlejax carries side "
                "inputs without gradients, so it must depend on the batch only. Name the "
                "blocks whose extra inputs come from the batch")
        self.checked[_shape_key(batch)] = info["out"]

    def _check_log(self, log: list) -> Any:
        n, where = len(self.block_keys), self.callsite
        order = [i for i, *_ in log]
        if order != list(range(n)):
            raise ValueError(f"{where}: __call__ runs the blocks in the order {order[:8]}; "
                             f"fiddlejax needs each of the {n} blocks called once, in order")
        out_def = None
        for i, args, kwargs, out in log:
            if not args or not isinstance(args[0], jax.Array):
                raise TypeError(f"{where}: block {i} gets no array as its first argument; "
                                "fiddlejax passes the activation first")
            leaves, tdef = jax.tree.flatten(out)
            arrays = [a for a in leaves if isinstance(a, jax.Array)]
            if len(arrays) != 1 or arrays[0].shape != args[0].shape:
                raise TypeError(
                    f"{where}: block {i} returns {_describe(out)}; fiddlejax carries one "
                    f"activation between blocks: an array shaped like the input "
                    f"{tuple(args[0].shape)}, alone or with Nones (e.g. (x, None))")
            out_def = out_def or tdef
            if i == 0:
                continue
            prev = _activation(log[i - 1][3])
            if args[0] is not prev:
                raise ValueError(
                    f"{where}: __call__ changes the activation between block {i - 1} and block "
                    f"{i}; fiddlejax runs the blocks back to back. Move that code into the "
                    "blocks, or declare the staged protocol (fiddlejax.staged)")
            first, now = jax.tree.flatten((log[0][1][1:], log[0][2])), jax.tree.flatten(
                (args[1:], kwargs))
            same = first[1] == now[1] and all(
                (x is y) if isinstance(x, jax.Array) else _equal(x, y)
                for x, y in zip(first[0], now[0], strict=True))
            if not same:
                raise ValueError(
                    f"{where}: block {i} receives other side inputs than block 0 (a per-layer "
                    "cache or mask?); fiddlejax passes every block the same side inputs")
        return out_def

    # -- the message: activation and side inputs in one [batch, features] array -------------
    def _pack(self, x: jax.Array, args: tuple, kwargs: dict) -> jax.Array:
        b = x.shape[0]
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [a for a in leaves if isinstance(a, jax.Array)]
        for a in arrays:
            if not (jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_
                    or jnp.issubdtype(a.dtype, jnp.floating)):
                raise TypeError(f"{self.callsite}: a side input of dtype {a.dtype} cannot travel "
                                "between stages")
            if (jnp.issubdtype(a.dtype, jnp.integer) and jnp.dtype(x.dtype).itemsize < 4):
                raise TypeError(
                    f"{self.callsite}: an integer side input ({a.dtype}{list(a.shape)}) would "
                    f"travel between stages in the {jnp.dtype(x.dtype).name} activation, which "
                    "rounds integers above 256 (bfloat16) or 2048 (float16). Use "
                    "compute_dtype='float32' for this model, or pass the blocks a boolean mask "
                    "or a float side input instead")
        per = [a if a.ndim and a.shape[0] == b else jnp.broadcast_to(a, (b, *a.shape))
               for a in arrays]
        side = _Side(treedef, tuple(None if isinstance(a, jax.Array) else a for a in leaves),
                     tuple(a.shape[1:] for a in per), tuple(a.dtype for a in per),
                     x.shape[1:], x.dtype)
        parts = [x.reshape(b, -1)] + [jax.lax.stop_gradient(a).reshape(b, -1).astype(x.dtype)
                                      for a in per]
        msg = jnp.concatenate(parts, axis=1)
        known = self.sides.setdefault(msg.shape[1:], side)
        if known.treedef != side.treedef or known.shapes != side.shapes:
            raise ValueError(f"{self.callsite}: two batch shapes give the same message width "
                             f"{msg.shape[1]}; use one batch shape per trainer")
        return msg

    def _unpack(self, msg: jax.Array, side: _Side):
        b = msg.shape[0]
        n = math.prod(side.x_shape)
        x = msg[:, :n].reshape(b, *side.x_shape).astype(side.x_dtype)
        start, arrays = n, []
        for shape, dtype in zip(side.shapes, side.dtypes, strict=True):
            size = math.prod(shape)
            a = jax.lax.stop_gradient(msg[:, start:start + size]).reshape(b, *shape)
            arrays.append(a.astype(dtype))
            start += size
        it = iter(arrays)
        leaves = [next(it) if s is None else s for s in side.statics]
        args, kwargs = jax.tree.unflatten(side.treedef, leaves)
        return x, args, kwargs


def _activation(out: Any) -> jax.Array:
    """The one array a block returns (alone, or in a tuple with Nones)."""
    arrays = [a for a in jax.tree.leaves(out) if isinstance(a, jax.Array)]
    if len(arrays) != 1:
        raise TypeError(f"a block returned {_describe(out)}; fiddlejax carries one activation")
    return arrays[0]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _shape_key(batch: dict) -> tuple:
    return tuple(sorted((k, tuple(np.shape(v))) for k, v in batch.items()))


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _depends(jaxpr: Any, n_inputs: int) -> list[bool]:
    """Whether each output of ``jaxpr`` depends on its first ``n_inputs`` inputs."""
    dep = {id(v) for v in jaxpr.invars[:n_inputs]}
    for eqn in jaxpr.eqns:
        if any(id(v) in dep for v in eqn.invars):
            dep.update(id(v) for v in eqn.outvars)
    return [id(v) in dep for v in jaxpr.outvars]


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


def _required_optional(params: list[inspect.Parameter]) -> frozenset:
    """The parameters without a default whose annotation admits None (``X | None``,
    ``Optional[X]``, also as strings): Flax's Gemma requires ``cache`` and trains with None."""
    out = set()
    for p in params:
        ann = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
        keyword = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        optional = {"None", "Optional"} & set(re.findall(r"\w+", ann))
        if keyword and optional and p.default is inspect.Parameter.empty:
            out.add(p.name)
    return frozenset(out)


def _describe(x) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__


def adapt(model: nnx.Module, loss_fn: Loss | None, layers: str) -> tuple[AdaptedModel, nnx.State]:
    """Split an unmodified ``model`` around the blocks at ``layers``; returns the staged model
    and the model's own (canonical) parameter tree."""
    name = type(model).__name__
    if loss_fn is None:
        if not callable(getattr(model, "loss", None)):
            raise TypeError(f"{name} has no loss(outputs, batch); pass parallelize(..., loss=fn) "
                            "with fn(outputs, batch) -> scalar mean or (sum, weight)")
        loss_fn = type(model).loss.__get__(model)
    check_dropout(model)
    params = [p for p in inspect.signature(type(model).__call__).parameters.values()
              if p.name != "self"]
    parent, attr, keys, blocks = _block_paths(model, layers)
    _bad_state(model, blocks, layers)
    sharding.infer_names(model)
    canonical = nnx.state(model, nnx.Param)
    sharding.check_ranks(canonical, name)
    unit = _unit(model, layers, blocks)
    # The model's state paths of each block (attributes below the root, then the key).
    prefix = tuple(layers.split(".")[:-1])
    if attr.endswith("*"):
        block_keys = tuple((*prefix, k) for k in keys)
    else:
        block_keys = tuple((*prefix, attr, k) for k in keys)
    unit_graphdefs, unit_rest = [], []
    for b in blocks[:unit]:
        gd, _, rest = nnx.split(b, nnx.Param, ...)
        unit_graphdefs.append(gd)
        unit_rest.append(rest)
    # The model without its blocks: stand-ins take their places (on a copy).
    copy = nnx.merge(*nnx.split(model), copy=True)
    host = copy
    for part in prefix:
        host = getattr(host, part)
    stand_ins = [_StandIn(i) for i in range(len(blocks))]
    if attr.endswith("*"):
        for k, s in zip(keys, stand_ins, strict=True):
            object.__setattr__(host, k, s)
    else:
        object.__setattr__(host, attr, tuple(stand_ins))
    graphdef, _, rest = nnx.split(copy, nnx.Param, ...)
    staged = AdaptedModel(
        graphdef=graphdef, rest=rest, stack=layers, layer_graphdef=tuple(unit_graphdefs),
        num_layers=len(blocks) // unit, loss_fn=loss_fn, unit=unit,
        unit_graphdefs=tuple(unit_graphdefs), unit_rest=tuple(unit_rest),
        block_keys=block_keys, template=_abstract(canonical), callsite=f"{name}.{layers}",
        call_names=tuple(p.name for p in params), call_nones=_required_optional(params))
    return staged, canonical


__all__ = ["AdaptedModel", "adapt", "check_dropout"]
