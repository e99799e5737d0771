"""Auxiliary-loss-free expert balancing (DeepSeek-V3): a router bias the step moves, not the
optimizer.

An MoE layer's :class:`RouterBias` ``[E]`` is added to the router's scores to choose the
experts only (no gradient reaches it). After every step each layer's bias moves by ``speed``
towards balance: ``bias += speed * sign(mean_e load - load)``, with ``load[e]`` the tokens the
layer sent expert ``e`` in the whole step.

How the loads travel: the model counts them in its message (``int32 [L, E]``, one row per
layer of the stack) and its loss reports them as a sum under :data:`LOADS`
(``fiddlejax.staged.Reported``), which every layout already adds up exactly (microbatches,
pipeline stages, data shards; int32). The step's exchange (:mod:`.exchange`) hands them to
:func:`steer` after the optimizer's update: the bias takes its old value plus the move, so
neither the gradient nor the optimizer (weight decay, momentum) ever moves it. The bias stays
in the parameters' tree (a subclass of ``nnx.Param``) so that it travels with its layer's
weights everywhere they go: pipeline stages, shardings, checkpoints, exports.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

LOADS = "router_loads"  # the reported sum: int32 [layers of the stack, experts]


class RouterBias(nnx.Param):
    """An expert-selection bias moved by :func:`steer` (metadata ``speed``), never by the
    optimizer."""


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def has_bias(params) -> bool:
    """Whether ``params`` hold a :class:`RouterBias`."""
    return any(isinstance(v, RouterBias) for v in jax.tree.leaves(params, is_leaf=_is_var))


def moves(loads: jax.Array) -> jax.Array:
    """``sign(mean_e load - load)`` per row of int32 ``loads [..., E]``, exactly (integers:
    ``mean = q + r / E`` with ``q, r = divmod(total, E)``, so nothing overflows or rounds)."""
    loads = loads.astype(jnp.int32)
    e = loads.shape[-1]
    total = jnp.sum(loads, -1, keepdims=True)
    q, r = total // e, total % e
    return jnp.where(loads < q, 1, jnp.where(loads > q, -1, jnp.where(r > 0, 1, 0)))


def steer(new, old, loads: jax.Array | None, rows: Callable = lambda a: a):
    """Parameters ``new`` (after the optimizer) with each :class:`RouterBias` set to its ``old``
    value moved by the step's ``loads`` (``[L, E]`` in layer order; ``rows`` maps them to the
    bias' layout, e.g. a pipeline's stacked ``[pipe, virtual, layers, E]``); ``loads`` None
    or a bias of speed 0: the old value, unmoved."""
    def one(n, o):
        if not isinstance(n, RouterBias):
            return n
        value, speed = o[...], n.get_metadata().get("speed", 0.0)
        if loads is not None and speed:  # speed 0 (an MTP block's): held, whatever its shape
            step = rows(moves(loads)).astype(value.dtype)
            if step.shape != value.shape:
                raise ValueError(f"the reported {LOADS} map to {step.shape}, but the router "
                                 f"bias is {value.shape}: report one row per layer of the stack")
            value = value + jnp.asarray(speed, value.dtype) * step
        return n.replace(value)

    return jax.tree.map(one, new, old, is_leaf=_is_var)


__all__ = ["LOADS", "RouterBias", "has_bias", "moves", "steer"]
