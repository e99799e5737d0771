"""fp8 matmuls (``Plan(matmul_dtype="fp8")``): a layer's dense matmuls in float8, the rest bf16.

Every ``dot_general`` of a layer with exactly one operand computed from the layer's parameters
(a dense matmul: ``x @ W``, an ``nnx.Linear``, an ``einsum`` against a kernel) runs on float8
operands: e4m3 forward, the incoming gradient e5m2 in the backward (more range, less precision,
as gradients need), each output in the compute dtype. Dots between activations (attention's
``q k^T`` and ``p v``) stay bf16, as Transformer Engine keeps them by default, and so does a
MoE router's (:func:`_routing`).

Scaling is per tensor and *current*: each operand is scaled by its own absmax at that step, one
reduction per operand, no state. Delayed scaling (an amax history carried between steps) saves
that reduction on a GPU but needs mutable state threaded through the step, the pipeline's ticks
and the remat recomputation, and goes wrong on the step a tensor's range jumps; current scaling
composes with all of them as a pure function. The quantized dot is qwix's
(``qwix._src.core.dot_general_qt``, Google's quantized-training library), per-tensor
(``disable_channelwise_axes``), reusing the forward's fp8 operands as residuals.

Which dots to convert is found without touching the model: :func:`layer` traces the layer to a
jaxpr, marks the values derived from its parameters (casts, reshapes, slices of a weight stay
weights) and evaluates it again with those dots replaced, inlining nested ``jit`` calls
(``jnp.einsum``, ``jnp.matmul``) and leaving other nested programs (a model's own remat, scans,
shard_maps) as they are. qwix's own interception (patching ``jax.lax.dot_general`` under a Flax
module context) needs the NNX module at call time; fiddlejax's stages call functions of
parameter trees. Not rewritten: the prologue (the embedding is a lookup, not a matmul) and the
head with its loss (logits feed a softmax over the vocabulary, where fp8's 3-bit mantissa costs
the most; Transformer Engine keeps the output layer in higher precision too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MATMUL_DTYPES = ("fp8",)


@functools.cache
def _config():
    from qwix._src.core import dot_general_qt  # a dependency of fiddlejax (pyproject)

    per_tensor = {f"{side}_disable_channelwise_axes": True for side in ("lhs", "rhs")}
    per_tensor |= {f"{side}_grad_disable_channelwise_axes": True for side in ("dlhs", "drhs")}
    return dot_general_qt, dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=E4M3, rhs_qtype=E4M3, dlhs_grad_qtype=E5M2, drhs_grad_qtype=E5M2, **per_tensor)


def dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers, out_dtype=None) -> jax.Array:
    """``jax.lax.dot_general`` on per-tensor-scaled float8 operands (e4m3; e5m2 gradients)."""
    qt, config = _config()
    out = qt.dot_general_qt(lhs, rhs, dimension_numbers, config)
    return out if out_dtype is None else out.astype(out_dtype)


def layer(f: Callable, params: Any, *args: Any) -> Any:
    """``f(params, *args)`` with its dense matmuls (a dot against ``params``) in fp8."""
    p_leaves, p_tree = jax.tree.flatten(params)
    a_leaves, a_tree = jax.tree.flatten(args)
    n = len(p_leaves)

    def flat(*leaves):
        out = f(jax.tree.unflatten(p_tree, leaves[:n]),
                *jax.tree.unflatten(a_tree, leaves[n:]))
        return out

    closed, shape = jax.make_jaxpr(flat, return_shape=True)(*p_leaves, *a_leaves)
    weights = [True] * n + [False] * len(a_leaves)
    outs, _ = _eval(closed.jaxpr, closed.consts, weights, [*p_leaves, *a_leaves])
    return jax.tree.unflatten(jax.tree.structure(shape), outs)


def count(f: Callable, params: Any, *args: Any) -> tuple[int, int]:
    """``(fp8, other)``: how many of ``f``'s dots :func:`layer` converts and leaves (traced on
    shapes)."""
    seen = [0, 0]

    def run(*a):
        return layer(f, *a)

    _COUNTER.append(seen)
    try:
        jax.eval_shape(run, params, *args)
    finally:
        _COUNTER.pop()
    return seen[0], seen[1]


_COUNTER: list[list[int]] = []
_INLINED = ("jit", "pjit", "closed_call")
_CHOICES = ("top_k", "approx_top_k", "argmax", "argmin")  # a router's decision


def _inner(eqn):
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def _routing(jaxpr, outs_routed) -> set:
    """The values that reach a discrete choice (a MoE router's ``top_k``) through no dot: the
    dot that makes them (the router's logits) stays bf16, as Megatron keeps its router out of
    fp8, so that rounding cannot flip which experts a token goes to."""
    marked = {v for v, r in zip(jaxpr.outvars, outs_routed, strict=True)
              if r and not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        if name in _INLINED:
            inner = _inner(eqn).jaxpr
            inside = _routing(inner, [v in marked for v in eqn.outvars])
            hit = [v for v, w in zip(eqn.invars, inner.invars, strict=True) if w in inside]
        elif name in _CHOICES or (name != "dot_general" and any(v in marked
                                                                 for v in eqn.outvars)):
            hit = eqn.invars
        else:
            continue
        marked.update(v for v in hit if not isinstance(v, Literal))
    return marked


def _eval(jaxpr, consts, weights, args, outs_routed=None) -> tuple[list, list[bool]]:
    """Evaluate ``jaxpr`` as ``jax.core.eval_jaxpr`` does, tracking which values derive from
    weights (``weights``: one flag per input) and replacing weight x activation dots (not a
    router's: :func:`_routing`)."""
    env: dict = {}
    is_w: dict = {}
    routed = _routing(jaxpr, outs_routed or [False] * len(jaxpr.outvars))

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    def weight(v) -> bool:
        return not isinstance(v, Literal) and is_w.get(v, False)

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v], is_w[v] = c, False
    for v, a, w in zip(jaxpr.invars, args, weights, strict=True):
        env[v], is_w[v] = a, w
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        flags = [weight(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "dot_general" and _dense(eqn, flags) and eqn.outvars[0] not in routed:
            outs, out_w = [dot(*vals, eqn.params["dimension_numbers"],
                               eqn.outvars[0].aval.dtype)], [False]
            _tally(0)
        elif name in _INLINED:
            inner = _inner(eqn)
            with eqn.ctx.manager:
                outs, out_w = _eval(inner.jaxpr, inner.consts, flags, vals,
                                    [v in routed for v in eqn.outvars])
        else:
            if name == "dot_general":
                _tally(1)
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
            outs = ans if eqn.primitive.multiple_results else [ans]
            derived = any(flags) and all(f for v, f in zip(eqn.invars, flags, strict=True)
                                         if not isinstance(v, Literal))
            out_w = [derived] * len(outs)
        for v, val, w in zip(eqn.outvars, outs, out_w, strict=True):
            env[v], is_w[v] = val, w
    return [read(v) for v in jaxpr.outvars], [weight(v) for v in jaxpr.outvars]


def _dense(eqn, flags) -> bool:
    """A dot of one weight-derived and one activation operand, both floating."""
    floating = all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars)
    return floating and flags[0] != flags[1]


def _tally(i: int) -> None:
    for seen in _COUNTER:
        seen[i] += 1


__all__ = ["E4M3", "E5M2", "MATMUL_DTYPES", "count", "dot", "layer"]
