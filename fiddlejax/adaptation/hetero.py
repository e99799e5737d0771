"""Blocks that differ (widths, strides, kinds): one stacked "layer" per pipeline chunk.

A sequence of unequal blocks (a CNN whose blocks downsample, an MLP whose widths change) has no
layer axis to stack. Here the blocks are cut into contiguous *groups*, one per pipeline chunk
(``pipe x virtual_stages``; one group without a pipeline), by PipeDream's dynamic program over
each block's measured cost (:func:`group_blocks`), and the staged model the pipeline sees has
one "layer" per group:

- parameters: each group's blocks flattened, per dtype, into one buffer padded to the largest
  group's (``[groups, size]`` under the stack's key: the pipeline splits it over ``pipe`` as any
  stack, one row per chunk, so padding costs at most the gap to the largest stage);
- activation: the message's ``"x"`` is a transfer buffer ``[batch, size]``, each example's
  activation flattened and padded to the largest one crossing a group boundary;
- the layer is a ``lax.switch`` over the groups on the message's block counter, each branch
  that group's blocks with their own static shapes, under a ``custom_vjp`` whose residuals are
  packed (per dtype, with and without a batch axis) into buffers sized for the largest group:
  a stage stashes what its own blocks need, not the union of every branch's residuals, and
  the blocks' parameters are not stashed at all (the backward rebuilds them from the layer's).

Every schedule then runs unchanged: to the runtime these are ``p x v`` equal layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fiddlejax import intercept
from fiddlejax.adaptation import dropout
from fiddlejax.adaptation.adapt import AdaptedModel, _shape_key
from fiddlejax.adaptation.side_inputs import activation, key, keys_of, unpack


def _value(v):
    return v.get_value() if isinstance(v, nnx.Variable) else v


@dataclasses.dataclass(frozen=True)
class HeteroModel(AdaptedModel):
    """An :class:`AdaptedModel` of unequal blocks, grouped one group per pipeline chunk.

    ``unit`` is the block count (every block its own graph definition, RNG streams and frozen
    state); ``num_layers`` is the group count."""

    groups: tuple = ((0, 1),)          # (first block, end) per group, contiguous
    # message key -> per block ((input shape, dtype), (output shape, dtype)) per example
    io: dict = dataclasses.field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.unit

    @property
    def reshapes(self) -> bool:
        return True

    @property
    def _counted(self) -> bool:
        return True

    def regrouped(self, counts: list[int]) -> HeteroModel:
        """This model with ``len(counts)`` groups of ``counts[g]`` consecutive blocks."""
        if sum(counts) != self.unit or min(counts) < 1:
            raise ValueError(f"counts={counts} must be positive and add up to the {self.unit} "
                             "blocks")
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return dataclasses.replace(self, groups=tuple(zip(starts[:-1], starts[1:])),
                                   num_layers=len(counts), checked={}, sides={}, io={})

    # -- parameters: the model's tree <-> one padded flat buffer per dtype and group -----------
    def _block_leaves(self) -> list[list[tuple[tuple, Any]]]:
        """Per block: its (path below the block, template leaf) in flat-state order."""
        flat = list(nnx.to_flat_state(self.template))
        return [[(p[len(k):], v) for p, v in flat if p[: len(k)] == k] for k in self.block_keys]

    def _sizes(self) -> dict[str, list[int]]:
        """Per dtype: each group's flat size."""
        per = self._block_leaves()
        out: dict[str, list[int]] = {}
        for d in self.param_dtypes:
            out[d] = [sum(math.prod(v.shape) for i in range(a, b) for _, v in per[i]
                          if jnp.dtype(v.dtype).name == d) for a, b in self.groups]
        return out

    @property
    def param_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({jnp.dtype(v.dtype).name for leaves in self._block_leaves()
                             for _, v in leaves}))

    def to_staged(self, params: nnx.State) -> nnx.State:
        values = {p: _value(v) for p, v in nnx.to_flat_state(params)}
        flat = list(nnx.to_flat_state(self.template))
        missing = [p for p, _ in flat if p not in values]
        if missing:
            raise ValueError(f"params lack {'/'.join(map(str, missing[0]))} of "
                             f"{self.callsite.split('.')[0]}'s parameter tree")
        inside = [any(p[: len(k)] == k for k in self.block_keys) for p, _ in flat]
        outer = [(p, t.replace(values[p]) if isinstance(t, nnx.Variable) else values[p])
                 for (p, t), b in zip(flat, inside) if not b]
        per, sizes = self._block_leaves(), self._sizes()
        stacked = []
        for d, group_sizes in sizes.items():
            width = max(group_sizes)
            rows = []
            for a, b in self.groups:
                parts = [jnp.ravel(values[(*self.block_keys[i], *sub)])
                         for i in range(a, b) for sub, v in per[i]
                         if jnp.dtype(v.dtype).name == d]
                row = jnp.concatenate(parts) if parts else jnp.zeros((0,), d)
                rows.append(jnp.pad(row, (0, width - row.shape[0])))
            like = next(v for leaves in per for _, v in leaves)  # a block's variable type
            value = jnp.stack(rows)
            stacked.append(((self.stack, d), like.replace(value, out_sharding=("layers", None))
                            if isinstance(like, nnx.Variable) else value))
        return nnx.from_flat_state(outer + stacked)

    def to_model(self, params: nnx.State) -> nnx.State:
        flat = {p: _value(v) for p, v in nnx.to_flat_state(params)}
        per = self._block_leaves()
        out, taken = [], {}
        for g, (a, b) in enumerate(self.groups):
            for d in self.param_dtypes:
                row, off = flat[(self.stack, d)][g], 0
                for i in range(a, b):
                    for sub, v in per[i]:
                        if jnp.dtype(v.dtype).name != d:
                            continue
                        n = math.prod(v.shape)
                        taken[(*self.block_keys[i], *sub)] = row[off:off + n].reshape(v.shape)
                        off += n
        for p, t in nnx.to_flat_state(self.template):
            value = taken[p] if p in taken else flat[p]
            out.append((p, t.replace(value) if isinstance(t, nnx.Variable) else value))
        return nnx.from_flat_state(out)

    def _unflatten(self, g: int, lp: dict) -> list[nnx.State]:
        """Group ``g``'s blocks' parameter states from its flat buffers ``{dtype: [size]}``."""
        a, b = self.groups[g]
        per, offs, out = self._block_leaves(), dict.fromkeys(lp, 0), []
        for i in range(a, b):
            leaves = []
            for sub, v in per[i]:
                d = jnp.dtype(v.dtype).name
                n = math.prod(v.shape)
                leaves.append((sub, lp[d][offs[d]:offs[d] + n].reshape(v.shape)))
                offs[d] += n
            out.append(nnx.from_flat_state(leaves))
        return out

    def _flatten(self, g: int, states: list, width: dict) -> dict:
        """The inverse of :meth:`_unflatten` (gradients), padded to ``width``."""
        parts: dict[str, list] = {d: [] for d in width}
        for s in states:
            for _, v in nnx.to_flat_state(s):
                v = _value(v)
                parts[jnp.dtype(v.dtype).name].append(jnp.ravel(v))
        out = {}
        for d, w in width.items():
            row = jnp.concatenate(parts[d]) if parts[d] else jnp.zeros((0,), d)
            out[d] = jnp.pad(row, (0, w - row.shape[0]))
        return out

    # -- the forward: prologue pads the activation, a layer runs one group ---------------------
    def prologue(self, params: nnx.State, batch: dict) -> dict:
        msg = super().prologue(params, batch)
        if self.checked[_shape_key(batch)][2]:  # side inputs with gradients (an encoder's)
            raise ValueError(
                f"{self.callsite}: a side input the unequal blocks receive is computed from the "
                "parameters (an encoder output?); a pipeline of unequal blocks carries side "
                "inputs without gradients: make the blocks at layers= equal (the decoder's "
                "blocks), or run the encoder inside them")
        io = tuple(tuple((tuple(a.shape[1:]), jnp.dtype(a.dtype)) for a in pair)
                   for pair in self.checked[_shape_key(batch)][3])
        bounds = [io[a][0] for a, _ in self.groups] + [io[-1][1]]
        dtypes = {d for _, d in bounds}
        if len(dtypes) > 1:
            raise ValueError(
                f"{self.callsite}: the activation changes dtype between blocks "
                f"({sorted(str(d) for d in dtypes)}); a pipeline of unequal blocks carries one "
                "transfer buffer: cast inside the blocks to one dtype at their boundaries")
        width = max(math.prod(s) for s, _ in bounds)
        x = msg["x"]
        flat = x.reshape(x.shape[0], -1)
        padded = {**msg, "x": jnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))}
        out_shape, out_dtype = io[-1][1]  # the stack's output, as the epilogue gets it
        last = {**msg, "x": jax.ShapeDtypeStruct((x.shape[0], *out_shape), out_dtype)}
        self.sides[key(padded)] = self.sides[key(last)] = self.sides[key(msg)]
        self.io[key(padded)] = io
        return padded

    def weighted_loss(self, params: nnx.State, x: Any, batch: dict):
        shape, _ = self.io[key(x)][-1][1]
        h = x["x"][:, :math.prod(shape)].reshape(x["x"].shape[0], *shape)
        return super().weighted_loss(params, {**x, "x": h}, batch)

    def _group(self, msg: dict) -> jax.Array:
        """The group whose first block is the message's next (its block counter)."""
        owner = np.zeros(self.unit, np.int32)
        for g, (a, b) in enumerate(self.groups):
            owner[a:b] = g
        return jnp.asarray(owner)[jnp.clip(keys_of(msg)[1], 0, self.unit - 1)]

    def layer(self, layer_params: nnx.State, x: dict, ops: Any = None) -> dict:
        """One group of blocks on the message: a switch on the group of its block counter."""
        io, side, ops = self.io[key(x)], self.sides[key(x)], self.with_offered(ops)
        lp = {p[0]: _value(v) for p, v in nnx.to_flat_state(nnx.State(layer_params))}
        rest = {k: v for k, v in x.items() if k != "x"}
        g = self._group(rest)
        width = x["x"].shape[1]
        sizes = {d: v.shape[0] for d, v in lp.items()}

        def run(g_, bp, h, rest_):
            a, b = self.groups[g_]
            h_, args, kwargs = unpack({**rest_, "x": h}, side)
            keys = keys_of(rest_)[0]
            for i, p in zip(range(a, b), bp):
                with dropout.keys(keys, i), intercept.setting(ops=ops):
                    h_ = activation(self._block(i, p, 0)(h_, *args, **kwargs),
                                    self.block_output)
            return h_

        def shaped(g_, h):  # the group's input from the transfer buffer
            s, d = io[self.groups[g_][0]][0]
            return h[:, :math.prod(s)].reshape(h.shape[0], *s).astype(d)

        def padded(y):
            y = y.reshape(y.shape[0], -1).astype(x["x"].dtype)
            return jnp.pad(y, ((0, 0), (0, width - y.shape[1])))

        y = _switched(self, run, shaped, padded, io, lp, x["x"], rest, sizes)
        step = jnp.asarray([b - a for a, b in self.groups], jnp.int32)[g]
        return {**x, "x": y, "count": x["count"] + step}


def _switched(model: HeteroModel, run, shaped, padded, io, lp: dict, h, rest: dict,
              sizes: dict):
    """``run`` of group ``g`` under a ``custom_vjp`` whose residuals are packed per group."""
    n = len(model.groups)
    batch = h.shape[0]

    def vjp_of(g_, lp_, h_, rest_):
        bp = model._unflatten(g_, lp_)
        y, vjp = jax.vjp(lambda p, hh: run(g_, p, hh, rest_), bp, shaped(g_, h_))
        leaves, tdef = jax.tree.flatten(vjp)
        bp_leaves = jax.tree.leaves(bp)
        src = [next((k for k, c in enumerate(bp_leaves) if leaf is c), None)
               for leaf in leaves]
        return y, leaves, tdef, src

    layouts = [_layout(vjp_of, k, lp, h, rest) for k in range(n)]
    res = _Residuals(layouts, batch)

    def plain(k):
        return lambda lp_, h_, rest_: padded(run(k, model._unflatten(k, lp_), shaped(k, h_),
                                                 rest_))

    def fwd_branch(k):
        def f(lp_, h_, rest_):
            y, leaves, _, src = vjp_of(k, lp_, h_, rest_)
            stored = [leaf for leaf, s in zip(leaves, src)
                      if s is None and isinstance(leaf, jax.core.Tracer)]
            return padded(y), res.pack(k, stored)
        return f

    def bwd_branch(k):
        def f(lp_, packed, rest_, dy):
            tdef, src, consts, _, _ = layouts[k]
            bp = model._unflatten(k, lp_)
            bp_leaves, it = jax.tree.leaves(bp), iter(res.unpack(k, packed))
            leaves = [bp_leaves[s] if s is not None else c if c is not None else next(it)
                      for s, c in zip(src, consts)]
            s, dt = io[model.groups[k][1] - 1][1]
            dbp, dh = jax.tree.unflatten(tdef, leaves)(
                dy[:, :math.prod(s)].reshape(batch, *s).astype(dt))
            return model._flatten(k, dbp, sizes), padded(dh).astype(dy.dtype)
        return f

    @jax.custom_vjp
    def apply(lp_, h_, rest_):
        return jax.lax.switch(model._group(rest_), [plain(k) for k in range(n)], lp_, h_, rest_)

    def apply_fwd(lp_, h_, rest_):
        y, packed = jax.lax.switch(model._group(rest_), [fwd_branch(k) for k in range(n)],
                                   lp_, h_, rest_)
        return y, (lp_, packed, rest_)

    def apply_bwd(res, dy):
        lp_, packed, rest_ = res
        dlp, dh = jax.lax.switch(model._group(rest_), [bwd_branch(k) for k in range(n)],
                                 lp_, packed, rest_, dy)
        drest = jax.tree.map(lambda r: r * 0 if jnp.issubdtype(r.dtype, jnp.inexact)
                             else np.zeros(r.shape, jax.dtypes.float0), rest_)
        return dlp, dh, drest

    apply.defvjp(apply_fwd, apply_bwd)
    return apply(lp, h, rest)


def _layout(vjp_of, g: int, lp: dict, h, rest: dict):
    """Shapes only: which residuals group ``g``'s backward needs stored (the rest are its
    parameters or constants), and where each sits in the per-(dtype, batched) buffers."""
    box = {}
    batch = h.shape[0]

    def trace(lp_, h_, rest_):
        _, leaves, tdef, src = vjp_of(g, lp_, h_, rest_)
        box["v"] = (tdef, src, [None if s is not None or isinstance(leaf, jax.core.Tracer)
                                else leaf for leaf, s in zip(leaves, src)])
        return [leaf for leaf, s in zip(leaves, src)
                if s is None and isinstance(leaf, jax.core.Tracer)]

    shapes = jax.eval_shape(trace, lp, h, rest)
    tdef, src, consts = box["v"]
    slots, used = [], {}
    for s in shapes:
        d, batched = jnp.dtype(s.dtype).name, bool(s.ndim) and s.shape[0] == batch
        size = math.prod(s.shape[1:]) if batched else math.prod(s.shape)
        off = used.get((d, batched), 0)
        slots.append((d, batched, off, size, s.shape))
        used[(d, batched)] = off + size
    return tdef, src, consts, slots, used


class _Residuals:
    """Each group's stored residuals in buffers sized for the largest group: one per (dtype,
    batched), ``[batch, width]`` or ``[width]``, so every branch of the switch returns the
    same shapes."""

    def __init__(self, layouts: list, batch: int):
        self.layouts, self.batch, self.widths = layouts, batch, {}
        for *_, used in layouts:
            for kb, u in used.items():
                self.widths[kb] = max(self.widths.get(kb, 0), u)

    def pack(self, k: int, stored: list) -> dict:
        parts: dict = {kb: [] for kb in self.widths}
        for leaf, (d, batched, _, _, _) in zip(stored, self.layouts[k][3]):
            parts[(d, batched)].append(leaf.reshape(self.batch, -1) if batched
                                       else leaf.ravel())
        out = {}
        for (d, batched), w in self.widths.items():
            ps = parts[(d, batched)]
            if batched:
                cat = jnp.concatenate(ps, 1) if ps else jnp.zeros((self.batch, 0), d)
                out[f"{d}/b"] = jnp.pad(cat, ((0, 0), (0, w - cat.shape[1])))
            else:
                cat = jnp.concatenate(ps) if ps else jnp.zeros((0,), d)
                out[f"{d}/u"] = jnp.pad(cat, (0, w - cat.shape[0]))
        return out

    def unpack(self, k: int, packed: dict) -> list:
        out = []
        for d, batched, off, size, shape in self.layouts[k][3]:
            buf = packed[f"{d}/{'b' if batched else 'u'}"]
            out.append((buf[:, off:off + size] if batched else buf[off:off + size])
                       .reshape(shape))
        return out


__all__ = ["HeteroModel"]


