"""What one pipeline stage does in one tick: forward, backward, or the split input/weight halves.

Each action is a small pure function from a :class:`TickIn` (the device's table row and the
buffer slots it reads) to a :class:`TickOut` (what it produced). The big buffers (stash, inbox,
gradient accumulators) never enter the per-tick ``lax.switch``: the executor reads the slots an
action needs before the switch and writes what it returns after it, one ``dynamic_update_slice``
each, so a tick's memory traffic does not depend on how many microbatches are in flight.

A chunk runs its layers one at a time under ``jax.vjp`` and keeps each layer's residuals
(stacked ``[lmax, ...]``), leaving out the residuals that are the layer's own parameters (the
backward passes them again). The same residuals serve a whole backward (B) and a split one: I
keeps the cotangent at every layer's output so that W computes only weight gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fiddlejax.pipeline import tables as tb


class TickIn(NamedTuple):
    row: tb.Row     # this device's table entry (traced scalars)
    x: jax.Array    # the inbox slot ``row.read``: input activation or cotangent
    res: list       # the stash slot ``row.stash``: residual leaves [lmax, ...]
    wdy: Any        # the wdy slot ``row.wdy`` (split backwards), else None


class TickOut(NamedTuple):
    out: jax.Array  # the message this tick sends (activation, cotangent or loss seed)
    res: list       # stash slot contents to write back (new residuals after F)
    wdy: Any        # wdy slot contents to write back (new cotangents after I)
    dcp: list       # weight gradients of the chunk's layers, leaves [lmax, ...]
    d_outer: list   # gradients of the parameters outside the stack (embedding, head)
    loss: jax.Array  # this microbatch's summed loss (last chunk's forward), else 0
    weight: jax.Array  # and its weight (the loss is sum / weight over the whole step)


class ChunkLayers:
    """A chunk's layers run one at a time: forward with residuals, and the three backwards.

    ``example_lp`` / ``example_x`` (one layer's parameters and an activation, traced where they
    will be used) fix which residual leaves are the layer's parameters.
    """

    def __init__(self, layer: Callable, lmax: int, uneven: bool, example_lp, example_x):
        self.layer, self.lmax, self.uneven = layer, lmax, uneven
        _, vjp = jax.vjp(lambda lp, h: self._one(lp, h, 0, lmax), example_lp, example_x)
        leaves, self._treedef = jax.tree.flatten(vjp)
        lp_leaves = jax.tree.leaves(example_lp)
        self._src = [next((k for k, c in enumerate(lp_leaves) if leaf is c), None)
                     for leaf in leaves]
        self.residuals = [leaf for leaf, k in zip(leaves, self._src) if k is None]

    def _one(self, lp, h, i, n):
        if self.uneven:  # chunks shorter than lmax skip their padding layers
            return jax.lax.cond(i < n, lambda: self.layer(lp, h), lambda: h)
        return self.layer(lp, h)

    def _rebuild(self, lp, res):
        lp_leaves, it = jax.tree.leaves(lp), iter(res)
        return jax.tree.unflatten(self._treedef, [next(it) if k is None else lp_leaves[k]
                                                  for k in self._src])

    def forward(self, cp, x, n):
        """-> (output, residual leaves stacked [lmax, ...])."""
        def body(h, args):
            i, lp = args
            h, vjp = jax.vjp(lambda l_, h_: self._one(l_, h_, i, n), lp, h)
            return h, [r for r, k in zip(jax.tree.leaves(vjp), self._src) if k is None]

        return jax.lax.scan(body, x, (jnp.arange(self.lmax), cp))

    def backward(self, cp, res, dy):
        """Whole backward -> (weight gradients [lmax, ...], input cotangent)."""
        def body(dh, args):
            lp, r = args
            dlp, dh = self._rebuild(lp, r)(dh)
            return dh, dlp

        dx, dcp = jax.lax.scan(body, dy, (cp, res), reverse=True)
        return dcp, dx

    def inputs(self, cp, res, dy):
        """Input half (I) -> (input cotangent, cotangents at each layer's output [lmax, ...])."""
        def body(dh, args):
            lp, r = args
            return self._rebuild(lp, r)(dh)[1], dh

        return jax.lax.scan(body, dy, (cp, res), reverse=True)

    def weights(self, cp, res, douts):
        """Weight half (W) -> the chunk's weight gradients, each layer independently."""
        def body(_, args):
            lp, r, d = args
            return None, self._rebuild(lp, r)(d)[0]

        return jax.lax.scan(body, None, (cp, res, douts))[1]


class Context(NamedTuple):
    """How a device reaches its parameters and data inside the scan (closures over its shard)."""

    chunk_params: Callable  # (local chunk, version) -> the chunk's layer params [lmax, ...]
    outer: Callable         # version -> leaves of the parameters outside the stack
    prologue: Callable      # (outer leaves, microbatch) -> activation entering chunk 0
    epilogue: Callable      # (outer leaves, activation, microbatch) -> (loss sum, weight)
    microbatch: Callable    # index -> the microbatch's batch dict
    vary: Callable          # marks a value varying over the manual axes (branches must agree)


def branches(ctx: Context, layers: ChunkLayers, zeros: TickOut, split: bool) -> list[Callable]:
    """The per-tick action functions, in the order of the branch indices in ``tables``.

    ``zeros`` holds a zero of every output (the values an action does not produce). A schedule
    uses whole or split backwards, never both: the other kind's branches stay idle (``switch``
    traces every branch).
    """
    def done(out: TickOut) -> TickOut:
        return jax.tree.map(ctx.vary, out)

    def idle(i: TickIn) -> TickOut:
        return done(zeros._replace(res=i.res, wdy=i.wdy))

    def forward(i: TickIn, first: bool, last: bool) -> TickOut:
        r = i.row
        cp, mb, outer = ctx.chunk_params(r.chunk, r.version), ctx.microbatch(r.microbatch), None
        x = i.x
        if first or last:
            outer = ctx.outer(r.version)
        if first:
            x = ctx.prologue(outer, mb).astype(i.x.dtype)
        y, res = layers.forward(cp, x, r.layers)
        if not last:
            return done(zeros._replace(out=y, res=res, wdy=i.wdy))
        # Seeded with the gradient of the loss *sum*: the step divides by the total weight once
        # all microbatches and data shards are in (an exact weighted mean).
        (total, weight), (d_outer, dy) = jax.value_and_grad(
            ctx.epilogue, argnums=(0, 1), has_aux=True)(outer, y, mb)
        return done(zeros._replace(out=dy.astype(y.dtype), res=res, wdy=i.wdy,
                                   d_outer=list(d_outer), loss=total.astype(zeros.loss.dtype),
                                   weight=weight.astype(zeros.weight.dtype)))

    def backward(i: TickIn, first: bool, whole: bool) -> TickOut:
        r = i.row
        cp = ctx.chunk_params(r.chunk, r.version)
        if whole:
            dcp, dx = layers.backward(cp, i.res, i.x)
            out = zeros._replace(dcp=dcp, res=i.res, wdy=i.wdy)
        else:
            dx, douts = layers.inputs(cp, i.res, i.x)
            out = zeros._replace(res=i.res, wdy=douts)
        if first:  # chunk 0: the prologue's gradients; nothing goes further back
            mb = ctx.microbatch(r.microbatch)
            _, pro_vjp = jax.vjp(lambda o: ctx.prologue(o, mb), ctx.outer(r.version))
            (d_outer,) = pro_vjp(dx)
            return done(out._replace(d_outer=list(d_outer)))
        return done(out._replace(out=dx))

    def weight(i: TickIn) -> TickOut:
        r = i.row
        dcp = layers.weights(ctx.chunk_params(r.chunk, r.version), i.res, i.wdy)
        return done(zeros._replace(res=i.res, wdy=i.wdy, dcp=dcp))

    table = [idle] * tb.NUM_BRANCHES
    table[tb.F_MID] = lambda i: forward(i, False, False)
    table[tb.F_FIRST] = lambda i: forward(i, True, False)
    table[tb.F_LAST] = lambda i: forward(i, False, True)
    table[tb.F_ONLY] = lambda i: forward(i, True, True)
    if split:
        table[tb.I_MID] = lambda i: backward(i, False, False)
        table[tb.I_FIRST] = lambda i: backward(i, True, False)
        table[tb.W] = weight
    else:
        table[tb.B_MID] = lambda i: backward(i, False, True)
        table[tb.B_FIRST] = lambda i: backward(i, True, True)
    return table


__all__ = ["ChunkLayers", "Context", "TickIn", "TickOut", "branches"]
