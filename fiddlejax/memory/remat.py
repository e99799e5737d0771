"""What one layer keeps for its backward: the plan's remat policy and Gist encodings.

A policy wraps each layer of the stack (``jax.checkpoint`` with a named policy); under FSDP or
a compute dtype the layer sees its parameters through the view (gathered, cast), and the view's
gathers are never saved. ``remat="auto"`` picks, on the first batch, the policy with the fewest
FLOPs whose compiled step fits ``Plan(memory_budget=)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from fiddlejax import checks, message
from fiddlejax.memory import storage


def layer_remat(policy: Any, zero) -> Callable[[Callable], Callable]:
    """How each layer is wrapped for ``policy`` (a name, a ``memory.policies`` policy, or
    "none"), seeing its parameters through ``zero.view`` when there is one."""
    from fiddlejax.memory import policies

    if zero.view is None:
        if policy in (None, "none"):
            return lambda f: f
        resolved = policies.resolve(policy)
        wrap = lambda f: policies.remat_layer(f, resolved)
        return InputsOnly(wrap) if resolved.name == "full" else wrap
    resolved = policies.resolve(None if policy == "none" else policy)
    wrap = lambda f: zero.view.layer(f, zero.layer_dims, resolved.jax_policy, zero.layer_specs)
    if not zero.prefetch:
        return InputsOnly(wrap) if resolved.name == "full" else wrap
    jax_policy = resolved.jax_policy
    return Prefetched(wrap, lambda f, unroll=False: zero.view.stack(
        f, zero.layer_dims, jax_policy, zero.layer_specs, unroll=unroll))


@dataclasses.dataclass(frozen=True)
class Prefetched:
    """A layer wrapper (``wrap``) whose whole stack can also run with FSDP's gathers one layer
    ahead (``stack(layer) -> run(stacked, x)``, :mod:`fiddlejax.compute.prefetch`)."""

    wrap: Callable[[Callable], Callable]
    stack: Callable[[Callable], Callable]

    def __call__(self, f: Callable) -> Callable:
        return self.wrap(f)


@dataclasses.dataclass(frozen=True)
class InputsOnly:
    """A layer wrapper for ``remat="full"``: each layer keeps only its inputs for the backward,
    so a stack of them (:func:`run_stack`) may keep those as it likes (:func:`inputs_as_bits`).
    """

    wrap: Callable[[Callable], Callable]

    def __call__(self, f: Callable) -> Callable:
        return self.wrap(f)


def inputs_as_bits(f: Callable) -> Callable:
    """``f(lp, x)`` (a layer that keeps only its inputs) keeping its 16-bit float inputs as
    ``uint16`` bits, as the pipeline's stash does: XLA's CPU widens 16-bit buffers to float32,
    so the kept inputs of a stack would take twice a GPU's bytes. The backward recomputes
    ``f``, as full remat does anyway. Only what is kept is bits: ``x`` itself stays a float
    (an integer carry has no cotangent, which would stop the gradient between layers)."""

    def run(lp, x):
        dtypes = jax.tree.map(lambda a: a.dtype, x)
        if all(storage.storage_dtype(d) == d for d in jax.tree.leaves(dtypes)):
            return f(lp, x)

        @jax.custom_vjp
        def kept(lp, x):
            return f(lp, x)

        def fwd(lp, x):
            return f(lp, x), (lp, jax.tree.map(storage.to_storage, x))

        def bwd(res, ct):
            lp, xb = res
            return jax.vjp(f, lp, jax.tree.map(storage.from_storage, xb, dtypes))[1](ct)

        kept.defvjp(fwd, bwd)
        return kept(lp, x)

    return run


def run_stack(remat: Callable, layer: Callable, stacked: Any, x: Any,
              unroll: bool = False) -> Any:
    """``x`` through the scanned stack of ``layer`` (``stacked``: parameters with a leading
    layer axis), each layer wrapped by ``remat``; prefetched where ``remat`` says so; under
    ``remat="full"`` each layer keeps its 16-bit inputs as bits (:func:`inputs_as_bits`);
    ``unroll``: as straight-line code (``Plan.unroll_layers``)."""
    x = message.align_varying(x, stacked)  # a loop carry of one type (a pytree message)
    if isinstance(remat, Prefetched):
        return remat.stack(layer, unroll=unroll)(stacked, x)
    wrapped = remat(layer)
    if isinstance(remat, InputsOnly):
        wrapped = inputs_as_bits(wrapped)

    def body(h, lp):
        out = wrapped(lp, h)
        message.check_layer(out, h)  # at trace time, before the scan's own type error
        return out, None

    return jax.lax.scan(body, x, stacked, unroll=unroll)[0]


def choose(lower_step: Callable[[Any], Any], budget: int):
    """``remat="auto"``: the policy with the fewest FLOPs whose compiled step fits ``budget``
    bytes; ``lower_step(policy)`` lowers the step under a candidate. Returns the policy."""
    from fiddlejax.memory import choose_policy

    return choose_policy(lower_step, int(budget))


def check_names(policy: Any, source, template, batch: dict, model_name: str) -> None:
    """A name-based policy on a layer that tags none of its names would silently equal
    remat='full': refuse it (traced on shapes, nothing runs)."""
    if policy in (None, "none", "auto"):
        return
    from fiddlejax.memory import policies

    params = source.to_staged(template)
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                         params[source.stack])
    rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), batch)
    x = jax.eval_shape(source.prologue, params, rows)
    checks.check_remat_names(policies.resolve(policy), source.layer, layer, x, model_name)
