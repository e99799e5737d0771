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
    x0: jax.Array   # the prologue's output for this tick's chunk-0 forward (else unused)
    res: list       # the stash slot ``row.stash``: residual leaves [lmax, ...]
    wdy: Any        # the wdy slot ``row.wdy`` (split backwards), else None


class TickOut(NamedTuple):
    out: jax.Array  # the tick's message: an activation or a cotangent (the last chunk's
                    # output goes to the head, chunk 0's input cotangent to the prologue)
    res: list       # stash slot contents to write back (new residuals after F)
    wdy: Any        # wdy slot contents to write back (new cotangents after I)
    dcp: list       # weight gradients of the chunk's layers, leaves [lmax, ...]


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
    """How a device reaches its layers' parameters inside the scan (closures over its shard)."""

    chunk_params: Callable  # (local chunk, version) -> the chunk's layer params [lmax, ...]
    vary: Callable          # marks a value varying over the manual axes (branches must agree)


def branches(ctx: Context, layers: ChunkLayers, zeros: TickOut, split: bool) -> list[Callable]:
    """The per-tick action functions, in the order of the branch indices in ``tables``.

    ``zeros`` holds a zero of every output (the values an action does not produce). A schedule
    uses whole or split backwards, never both: the other kind's branches stay idle (``switch``
    traces every branch). The prologue and the head run outside the switch, over every device
    (``executor``): chunk 0's forward takes the prologue's output ``x0``, the last chunk's
    output and chunk 0's input cotangent leave as the tick's message.
    """
    def done(out: TickOut) -> TickOut:
        return jax.tree.map(ctx.vary, out)

    def idle(i: TickIn) -> TickOut:
        return done(zeros._replace(res=i.res, wdy=i.wdy))

    def forward(i: TickIn, first: bool) -> TickOut:
        r = i.row
        y, res = layers.forward(ctx.chunk_params(r.chunk, r.version),
                                i.x0.astype(i.x.dtype) if first else i.x, r.layers)
        return done(zeros._replace(out=y, res=res, wdy=i.wdy))

    def backward(i: TickIn, whole: bool) -> TickOut:
        cp = ctx.chunk_params(i.row.chunk, i.row.version)
        if whole:
            dcp, dx = layers.backward(cp, i.res, i.x)
            return done(zeros._replace(out=dx, dcp=dcp, res=i.res, wdy=i.wdy))
        dx, douts = layers.inputs(cp, i.res, i.x)
        return done(zeros._replace(out=dx, res=i.res, wdy=douts))

    def weight(i: TickIn) -> TickOut:
        r = i.row
        dcp = layers.weights(ctx.chunk_params(r.chunk, r.version), i.res, i.wdy)
        return done(zeros._replace(res=i.res, wdy=i.wdy, dcp=dcp))

    table = [idle] * tb.NUM_BRANCHES
    table[tb.F_MID] = table[tb.F_LAST] = lambda i: forward(i, False)
    table[tb.F_FIRST] = table[tb.F_ONLY] = lambda i: forward(i, True)
    if split:
        table[tb.I_MID] = table[tb.I_FIRST] = lambda i: backward(i, False)
        table[tb.W] = weight
    else:
        table[tb.B_MID] = table[tb.B_FIRST] = lambda i: backward(i, True)
    return table


__all__ = ["ChunkLayers", "Context", "TickIn", "TickOut", "branches"]
