"""What one layer keeps for its backward: the plan's remat policy and Gist encodings.

A policy wraps each layer of the stack (``jax.checkpoint`` with a named policy); under FSDP or
a compute dtype the layer sees its parameters through the view (gathered, cast), and the view's
gathers are never saved. ``remat="auto"`` picks, on the first batch, the policy with the fewest
FLOPs whose compiled step fits ``Plan(memory_budget=)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from fiddlejax import checks


def layer_remat(policy: Any, zero) -> Callable[[Callable], Callable]:
    """How each layer is wrapped for ``policy`` (a name, a ``memory.policies`` policy, or
    "none"), seeing its parameters through ``zero.view`` when there is one."""
    from fiddlejax.memory import policies

    if zero.view is None:
        if policy in (None, "none"):
            return lambda f: f
        resolved = policies.resolve(policy)
        return lambda f: policies.remat_layer(f, resolved)
    jax_policy = policies.resolve(None if policy == "none" else policy).jax_policy
    wrap = lambda f: zero.view.layer(f, zero.layer_dims, jax_policy, zero.layer_specs)
    if not zero.prefetch:
        return wrap
    return Prefetched(wrap, lambda f, unroll=False: zero.view.stack(
        f, zero.layer_dims, jax_policy, zero.layer_specs, unroll=unroll))


@dataclasses.dataclass(frozen=True)
class Prefetched:
    """A layer wrapper (``wrap``) whose whole stack can also run with FSDP's gathers one layer
    ahead (``stack(layer) -> run(stacked, x)``, :mod:`fiddlejax.prefetch`)."""

    wrap: Callable[[Callable], Callable]
    stack: Callable[[Callable], Callable]

    def __call__(self, f: Callable) -> Callable:
        return self.wrap(f)


def run_stack(remat: Callable, layer: Callable, stacked: Any, x: Any,
              unroll: bool = False) -> Any:
    """``x`` through the scanned stack of ``layer`` (``stacked``: parameters with a leading
    layer axis), each layer wrapped by ``remat``; prefetched where ``remat`` says so;
    ``unroll``: as straight-line code (``Plan.unroll_layers``)."""
    if isinstance(remat, Prefetched):
        return remat.stack(layer, unroll=unroll)(stacked, x)
    wrapped = remat(layer)
    return jax.lax.scan(lambda h, lp: (wrapped(lp, h), None), x, stacked, unroll=unroll)[0]


def choose(lower_step: Callable[[Any], Any], budget: int):
    """``remat="auto"``: the policy with the fewest FLOPs whose compiled step fits ``budget``
    bytes; ``lower_step(policy)`` lowers the step under a candidate. Returns the policy."""
    from fiddlejax.memory import choose_policy

    return choose_policy(lower_step, int(budget))


def encodings(names) -> contextlib.AbstractContextManager:
    """The Gist encodings the plan names, active while a step is traced."""
    if not names:
        return contextlib.nullcontext()
    from fiddlejax.memory import gist

    return gist.encodings(list(names))


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
