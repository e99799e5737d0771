"""What one pipeline stage does in one tick: forward, backward, or the split input/weight halves.

A tick has no ``switch``: each kind of action is a loop over the chunk's layers whose trip count
is the chunk's layer count when the device's row asks for that action and 0 otherwise (for
chunks of one layer, a conditional: see ``_loop``). The big
buffers (stash, gradient accumulators, the cotangents I keeps for W) are the loops' carries, and
each layer reads and writes only its own slice of them with ``dynamic_slice`` /
``dynamic_update_slice``, so XLA updates them in place: no slot is copied out and back, no
gradient is held twice (the weight gradients are added into the accumulator the optimizer reads,
layer by layer), and a tick's memory traffic is what its layers touch, whatever ``m`` is.

A chunk runs its layers one at a time under ``jax.vjp`` and keeps each layer's residuals,
leaving out the residuals that are the layer's own parameters (the backward passes them again).
The same residuals serve a whole backward (B) and a split one: I keeps the cotangent at every
layer's output so that W computes only weight gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fiddlejax import message
from fiddlejax.memory.storage import from_storage, storage_dtype, to_storage
from fiddlejax.pipeline import tables as tb


class Buffers(NamedTuple):
    """The per-stage buffers a tick's loops carry (a device's slices, no ``pipe`` axis)."""

    stash: list       # residual leaves [1, num_stash, lmax, ...]
    grad: list        # weight-gradient accumulators [1, (versions,) v, lmax, ...]
    wdy: Any          # [1, num_wdy, lmax, *message]: I's cotangents for W (split), else None
    # (the leading axis is the device's slice of ``pipe``, kept: a reshape there would let XLA
    # pick another layout for the loop's buffers and copy them whole every tick)


class Layers:
    """One layer of the stack under ``jax.vjp``, its residuals stored explicitly.

    ``example_lp`` / ``example_x`` (one layer's parameters and an activation, traced where they
    will be used) fix which residual leaves are the layer's parameters.
    """

    def __init__(self, layer: Callable, example_lp, example_x):
        self.layer = layer
        out, vjp = jax.vjp(layer, example_lp, example_x)
        message.check_layer(out, example_x)
        leaves, self._treedef = jax.tree.flatten(vjp)
        lp_leaves = jax.tree.leaves(example_lp)
        self._src = [next((k for k, c in enumerate(lp_leaves) if leaf is c), None)
                     for leaf in leaves]
        self.residuals = [leaf for leaf, k in zip(leaves, self._src) if k is None]

    def forward(self, lp, h):
        """-> (output, residual leaves)."""
        h, vjp = jax.vjp(self.layer, lp, h)
        return h, [r for r, k in zip(jax.tree.leaves(vjp), self._src) if k is None]

    def vjp(self, lp, res) -> Callable:
        """The layer's vjp function rebuilt from its stored residuals."""
        lp_leaves, it = jax.tree.leaves(lp), iter(res)
        return jax.tree.unflatten(self._treedef, [next(it) if k is None else lp_leaves[k]
                                                  for k in self._src])

    def backward(self, lp, res, dy) -> tuple:
        """``(parameter cotangents, input cotangent)`` of the layer for the output cotangent
        ``dy``, both messages as buffers hold them (:mod:`.message`)."""
        dlp, dx = self.vjp(lp, res)(message.to_vjp(dy))
        return dlp, message.from_vjp(dx, dy)


def read_at(buf, idx: tuple):
    """``buf[idx]`` for an index tuple over the leading dimensions (leaf by leaf for a
    message's buffers)."""
    def one(b):
        start = (*idx, *([0] * (b.ndim - len(idx))))
        return jax.lax.dynamic_slice(b, start, (1,) * len(idx) + b.shape[len(idx):]).reshape(
            b.shape[len(idx):])
    return jax.tree.map(one, buf)


def write_at(buf, idx: tuple, x):
    """``buf[idx] = x`` in place (leaf by leaf for a message's buffers)."""
    def one(b, v):
        v = v.astype(b.dtype).reshape((1,) * len(idx) + tuple(v.shape))
        return jax.lax.dynamic_update_slice(b, v, (*idx, *([0] * (b.ndim - len(idx)))))
    return jax.tree.map(one, buf, x)


def add_at(buf, idx: tuple, x):
    """``buf[idx] += x`` in place, as a scatter-add: XLA runs it in place, the cast of ``x``
    fused in. (Read, add and update-slice materialise the slice read: a whole float32 layer
    of the largest leaf beside its fresh gradient, 3 GiB for GPT-OSS-120B's experts.)"""
    return buf.at[idx].add(x.astype(buf.dtype), mode="promise_in_bounds")


def _loop(one: bool, trips, body: Callable, carry):
    """``body`` over a chunk's layers ``trips`` times (0 when the row does not ask for it). A
    chunk of ``one`` layer runs under a conditional instead: in a loop its reads would not
    depend on the counter (a dimension of size 1 ignores its index), XLA hoists the layer's
    work out of the loop, and it runs every tick whatever the trip count (zb-v and
    interleaved-zb at 8 layers on 4 stages ran a whole weight gradient in every tick: 11 of
    an idle tick's 11.2 ms on the CPU)."""
    if one:
        return jax.lax.cond(trips > 0, lambda c: body(jnp.int32(0), c), lambda c: c, carry)
    return jax.lax.fori_loop(0, trips, body, carry)


def tick(layers: Layers, params: Callable, buf: Buffers, row: tb.Row, grad_at: tuple, x,
         split: bool, vary: Callable, lockstep: Any = None) -> tuple[Buffers, Any]:
    """One stage's action for ``row`` on input ``x`` (a message for F, its cotangent for
    B and I). ``params(i)`` is layer ``i`` of the row's chunk and version, ``grad_at`` that
    chunk's index in the accumulators. Returns the updated buffers and the tick's message (F's
    output or the input cotangent of B and I).

    ``lockstep``: None, or the tick's trip counts per loop ``[forward, whole, input, weight]``,
    the same on every stage (:mod:`fiddlejax.pipeline.lockstep`): every stage then runs every
    loop that any stage runs this tick, and keeps only its own action's results, so that each
    collective inside a layer is reached by every device."""
    n, b = row.layers, row.branch
    forward = (b == tb.F_MID) | (b == tb.F_FIRST) | (b == tb.F_LAST) | (b == tb.F_ONLY)
    whole = (b == tb.B_MID) | (b == tb.B_FIRST)
    inputs = (b == tb.I_MID) | (b == tb.I_FIRST)
    slot = (0, row.stash)

    def trips(on, kind):
        return jnp.where(on, n, 0) if lockstep is None else lockstep[kind]

    one = bool(buf.stash) and buf.stash[0].shape[2] == 1  # chunks of one layer: see _loop

    def keep(on, k, new, old):  # a lockstep loop keeps its results only where the row acts
        if lockstep is None:
            return new
        live = on & (k < n)
        return jax.tree.map(lambda a, o: jnp.where(live, a, o), new, old)

    def res_of(stash, i):  # a layer's residuals, unpacked to their dtypes
        return [from_storage(read_at(s, (*slot, i)), r.dtype)
                for s, r in zip(stash, layers.residuals)]

    def fwd(i, c):
        h, stash = c
        out, res = layers.forward(params(i), h)
        res = keep(forward, i, [to_storage(r) for r in res],
                   [read_at(s, (*slot, i)) for s in stash] if lockstep is not None else None)
        return (jax.tree.map(vary, keep(forward, i, out, h)),
                [write_at(s, (*slot, i), r) for s, r in zip(stash, res)])

    h, stash = _loop(one, trips(forward, 0), fwd, (x, buf.stash))

    def add_grads(on, k, grad, i, dlp):  # into the accumulator the optimizer reads, in place
        dlp = jax.tree.leaves(dlp)
        if lockstep is not None:
            dlp = keep(on, k, dlp, [jnp.zeros_like(d) for d in dlp])
        return [add_at(g, (*grad_at, i), d) for g, d in zip(grad, dlp)]

    dx, grad, wdy = x, buf.grad, buf.wdy
    if not split:
        def bwd(k, c):  # B: layers in reverse, each layer's weight gradient added in place
            dh, grad = c
            i = jnp.maximum(n - 1 - k, 0)
            dlp, dh_new = layers.backward(params(i), res_of(stash, i), dh)
            return (jax.tree.map(vary, keep(whole, k, dh_new, dh)),
                    add_grads(whole, k, grad, i, dlp))

        dx, grad = _loop(one, trips(whole, 1), bwd, (x, grad))
    else:
        def inp(k, c):  # I: the input-gradient chain, keeping each layer's output cotangent
            dh, wdy = c
            i = jnp.maximum(n - 1 - k, 0)
            wdy = write_at(wdy, (0, row.wdy, i),
                           keep(inputs, k, dh, read_at(wdy, (0, row.wdy, i))))
            dh_new = layers.backward(params(i), res_of(stash, i), dh)[1]
            return jax.tree.map(vary, keep(inputs, k, dh_new, dh)), wdy

        dx, wdy = _loop(one, trips(inputs, 2), inp, (dx, wdy))

        def wgt(i, grad):  # W: each layer's weight gradient from the cotangent I kept
            return add_grads(b == tb.W, i, grad, i, layers.backward(
                params(i), res_of(stash, i), read_at(wdy, (0, row.wdy, i)))[0])

        grad = _loop(one, trips(b == tb.W, 3), wgt, grad)
    return Buffers(stash, grad, wdy), message.where(forward, h, dx)


def lockstep_trips(rows) -> jax.Array:
    """Per tick, ``[forward, whole, input, weight]`` loop trips that every stage runs in
    lockstep: the most layers any stage's row asks of that loop (``rows``: ``[p, fields]``)."""
    r = tb.Row(*(rows[:, k] for k in range(rows.shape[1])))
    b = r.branch
    kinds = [(b == tb.F_MID) | (b == tb.F_FIRST) | (b == tb.F_LAST) | (b == tb.F_ONLY),
             (b == tb.B_MID) | (b == tb.B_FIRST), (b == tb.I_MID) | (b == tb.I_FIRST),
             b == tb.W]
    return jnp.stack([jnp.max(jnp.where(on, r.layers, 0)) for on in kinds])


__all__ = ["Buffers", "Layers", "add_at", "lockstep_trips", "read_at", "storage_dtype", "tick",
           "write_at"]
