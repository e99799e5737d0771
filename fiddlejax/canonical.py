"""Whole training states between a layout and the canonical tree users and checkpoints see.

optax states mirror the parameters, so every parameter-shaped subtree takes the parameters'
exact conversion (stage regrouping, vocabulary unpadding) with its own shardings; counters pass
through. A top-k residual converts per replica and keeps its leading ``data`` dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import optax

from fiddlejax.parallel import zero as zero_
from fiddlejax.state import TrainState

if TYPE_CHECKING:
    from fiddlejax.parallel.layout import Layout


def convert_state(lay: Layout, optimizer: optax.GradientTransformation, fn: Callable,
                  s: TrainState) -> TrainState:
    """``s`` with each parameter-shaped tree converted by ``fn(tree, shardings)``."""

    def whole(tree, shardings=None):  # fn converts whole parameter trees
        if not any(zero_.masked(x) for x in jax.tree.leaves(tree, is_leaf=zero_.masked)):
            return fn(tree, shardings)  # (an adapted model's trees differ in structure)
        # Parameters a part of the state leaves out (optax.MaskedNode: Muon's AdamW half,
        # optax.masked) ride through as the parameters and are put back after.
        filled = jax.tree.map(lambda x, p: p if zero_.masked(x) else x, tree, s.params,
                              is_leaf=zero_.masked)
        return jax.tree.map(lambda x, y: x if zero_.masked(x) else y, tree,
                            fn(filled, shardings), is_leaf=zero_.masked)

    def opt_convert(o):  # each parameter-shaped tree with its own shardings
        own = iter(param_trees(optimizer, lay.opt_shardings))
        return optax.tree_map_params(optimizer, lambda t: whole(t, next(own)), o,
                                     is_leaf=lambda _: True)

    # topk_on="updates": per-replica optimizer states convert replica by replica
    opt = (jax.vmap(opt_convert) if lay.stepper.local_optimizer else opt_convert)(s.opt_state)
    residual = None if s.residual is None else jax.vmap(fn)(s.residual)
    prev = None if s.prev_params is None else fn(s.prev_params)
    return TrainState(s.step, fn(s.params), opt, residual, prev)


def converters(lay: Layout, optimizer: optax.GradientTransformation):
    """Jitted ``(to_canonical, to_internal)`` for whole states of this layout."""
    return (jax.jit(lambda s: convert_state(lay, optimizer, lay.to_canonical, s)),
            jax.jit(lambda s: convert_state(lay, optimizer, lay.to_internal, s),
                    out_shardings=lay.state_shardings))


def param_trees(optimizer, opt_tree) -> list:
    """The parameter-shaped subtrees of an optimizer-state-shaped tree, in the order
    ``optax.tree_map_params`` visits them."""
    found: list = []
    optax.tree_map_params(optimizer, lambda t: found.append(t) or t, opt_tree,
                          is_leaf=lambda _: True)
    return found


def param_shardings(lay: Layout, abstract_params) -> object:
    """The shardings the canonical parameters come out in (the layout's own conversion,
    compiled, not run): where a loader places each leaf."""
    return jax.jit(lay.to_canonical).lower(abstract_params).compile().output_shardings
