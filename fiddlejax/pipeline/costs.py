"""What each piece of a staged model costs, for balancing pipeline stages.

``params``: parameter counts (a layer's, and those of the shared parameters the prologue and the
epilogue actually read, found by data flow in their jaxprs). ``cost``: compiled training FLOPs
(forward + backward, ``cost_analysis``) of the prologue, one layer and the epilogue on one
example. Layers in a stack are identical, so one layer's cost stands for all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z0-9]+\[([0-9,]*)\]")


def _used_inputs(fn: Callable, *args) -> list[bool]:
    """Which flattened inputs of ``fn(*args)`` its jaxpr reads."""
    closed = jax.make_jaxpr(fn)(*args)
    used = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in closed.jaxpr.outvars}
    return [id(v) in used for v in closed.jaxpr.invars]


def _flops(fn: Callable, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost or {}).get("flops", 0.0))


def hlo_dot_flops(hlo_text: str) -> float:
    """Matrix-multiply FLOPs (2 x output elements x contracted size) of a compiled HLO module.

    Counts every ``dot`` in every computation once, fused or not. Unlike ``cost_analysis()``
    it leaves out elementwise work, whose count moves with XLA's fusion choices: this is the
    number to compare between two programs that should do the same model math. Loops must be
    unrolled to be counted in full.
    """
    shapes = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:  # instruction names are unique within an HLO module
            shapes[m.group(1)] = [int(d) for d in m.group(2).split(",") if d]
    total = 0
    for line in hlo_text.splitlines():
        if " dot(" not in line:
            continue
        out = shapes[_DEF.match(line).group(1)]
        lhs = shapes[re.search(r" dot\(%?([\w.\-]+)", line).group(1)]
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
        k = math.prod(lhs[int(i)] for i in dims.group(1).split(",") if i) if dims else 1
        total += 2 * math.prod(out) * k
    return float(total)


def unpipelined_flops(staged, params: nnx.State, batch: dict, remat: Callable) -> dict:
    """``{"flops", "dot_flops"}`` of one device's whole training step without a pipeline.

    The reference for :meth:`Pipeline.stage_flops`: prologue, every layer (``remat`` applied,
    the loop unrolled so that every layer is counted), epilogue, and their gradients.
    """
    layer = remat(staged.layer)

    def loss(p, b):
        x = staged.prologue(p, b)
        for i in range(staged.num_layers):
            x = layer(jax.tree.map(lambda a, i=i: a[i], p[staged.stack]), x)
        return staged.epilogue(p, x, b)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    return {"flops": float(compiled.cost_analysis()["flops"]),
            "dot_flops": hlo_dot_flops(compiled.as_text())}


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
            def loss(*a):  # a message's floating leaves (integers carry no gradient)
                return sum(jax.numpy.sum(v) for v in jax.tree.leaves(f(*a))
                           if jax.numpy.issubdtype(v.dtype, jax.numpy.inexact))
            return _flops(jax.grad(loss, argnums=tuple(range(n_diff)), allow_int=True), *args)

        layer_cost = train_cost(staged.layer, 2, layer, x)
        first = train_cost(pro, 1, outer, example)
        last = train_cost(epi, 2, outer, x, example)
        return layer_cost, first, last
    raise ValueError(f"method={method!r} must be 'params' or 'cost'")
