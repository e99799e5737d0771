"""What each piece of a staged model costs, for balancing pipeline stages.

``params``: parameter counts (a layer's, and those of the shared parameters the prologue and the
epilogue actually read, found by data flow in their jaxprs). ``cost``: compiled training FLOPs
(forward + backward, ``cost_analysis``) of the prologue, one layer and the epilogue on one
example. Layers in a stack are identical, so one layer's cost stands for all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx


def _used_inputs(fn: Callable, *args) -> list[bool]:
    """Which flattened inputs of ``fn(*args)`` its jaxpr reads."""
    closed = jax.make_jaxpr(fn)(*args)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in closed.jaxpr.outvars}
    return [id(v) in used for v in closed.jaxpr.invars]


def _flops(fn: Callable, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost or {}).get("flops", 0.0))


def _split(params: nnx.State, stack: str):
    """(outer leaves, one layer's params, a function rebuilding the full tree)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    in_stack = [getattr(path[0], "key", None) == stack for path, _ in flat]
    leaves = [x for _, x in flat]
    outer = [x for x, s in zip(leaves, in_stack) if not s]
    stacked = [x for x, s in zip(leaves, in_stack) if s]

    def assemble(o):
        it_o, it_s = iter(o), iter(stacked)
        return jax.tree.unflatten(treedef, [next(it_s) if s else next(it_o) for s in in_stack])

    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params[stack])
    return outer, layer, assemble


def measure(staged, params: nnx.State, example: dict, method: str) -> tuple[float, float, float]:
    """(layer cost, prologue cost, epilogue cost) by ``method`` (``params`` or ``cost``)."""
    outer, layer, assemble = _split(params, staged.stack)
    def pro(o, ex):
        return staged.prologue(assemble(o), ex)

    def epi(o, h, ex):
        return staged.epilogue(assemble(o), h, ex)

    x = jax.eval_shape(pro, outer, example)

    if method == "params":
        layer_n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(layer))
        sizes = [int(np.prod(a.shape)) for a in outer]
        first = sum(n for n, u in zip(sizes, _used_inputs(pro, outer, example)) if u)
        last = sum(n for n, u in zip(sizes, _used_inputs(epi, outer, x, example)) if u)
        return float(layer_n), float(first), float(last)
    if method == "cost":
        def train_cost(f, n_diff, *args):  # forward + backward w.r.t. the first n_diff args
            loss = lambda *a: jax.numpy.sum(f(*a))  # noqa: E731
            return _flops(jax.grad(loss, argnums=tuple(range(n_diff))), *args)

        layer_cost = train_cost(staged.layer, 2, layer, x)
        first = train_cost(pro, 1, outer, example)
        last = train_cost(epi, 2, outer, x, example)
        return layer_cost, first, last
    raise ValueError(f"method={method!r} must be 'params' or 'cost'")
