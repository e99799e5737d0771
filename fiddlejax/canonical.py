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
    """``(to_canonical, to_internal)`` for whole states of this layout (:class:`Forwarding`:
    lowerable; called, leaves the conversion leaves as they are come back as the same
    arrays; ``.copied`` copies every leaf, as a plain ``jax.jit`` does)."""
    return (Forwarding(lambda s: convert_state(lay, optimizer, lay.to_canonical, s)),
            Forwarding(lambda s: convert_state(lay, optimizer, lay.to_internal, s),
                       lay.state_shardings))


class Forwarding:
    """``jax.jit(fn)`` whose outputs that are inputs, unchanged and placed alike, are those
    input arrays. A jitted function copies every output, so converting a state whose leaves
    the conversion leaves alone (most of them under data parallelism and zero=3) held a second
    copy of the whole state while a checkpoint saved it (6x the bf16 checkpoint's bytes for
    AdamW; on a GPU, twice the state in device memory) and while one restored. Which outputs
    are forwarded is read from the traced program (an output variable that is an input
    variable), once per input structure; the others run in one jitted program.

    The result shares those buffers with the input: donating either (a training step
    donates its state) deletes them in both. The checkpoint manager converts a state it then
    drops; a user's ``Trainer.to_canonical_state`` gets :meth:`copied`."""

    def __init__(self, fn: Callable, out_shardings=None):
        self._fn, self._out = fn, out_shardings
        self._jit = jax.jit(fn) if out_shardings is None else jax.jit(
            fn, out_shardings=out_shardings)
        self._plans: dict = {}

    def lower(self, *args):
        return self._jit.lower(*args)

    def copied(self, state):
        return self._jit(state)

    def __call__(self, state):
        leaves, tree = jax.tree.flatten(state)
        if any(isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) for x in leaves):
            return self._jit(state)  # traced (eval_shape, a user's jit) or host values
        key = (tree, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
        if key not in self._plans:
            self._plans[key] = self._plan(state, leaves)
        forwarded, rest, out_tree = self._plans[key]
        computed = iter(rest(state) if rest is not None else ())
        return jax.tree.unflatten(out_tree, [leaves[i] if i is not None else next(computed)
                                             for i in forwarded])

    def _plan(self, state, leaves):
        closed, shape = jax.make_jaxpr(self._fn, return_shape=True)(state)
        where = {id(v): i for i, v in enumerate(closed.jaxpr.invars)}
        outs, out_tree = jax.tree.flatten(shape)
        try:  # the target shardings, one per output leaf (a None leaf has none)
            wanted = ([None] * len(outs) if self._out is None
                      else out_tree.flatten_up_to(self._out))
        except (ValueError, TypeError):
            return [None] * len(outs), self._jit_leaves(), out_tree  # copy all, as jit does
        forwarded = []
        for v, want in zip(closed.jaxpr.outvars, wanted):
            i = where.get(id(v))
            same = i is not None and (want is None or _alike(leaves[i], want))
            forwarded.append(i if same else None)
        keep = [k for k, i in enumerate(forwarded) if i is None]
        if not keep:
            return forwarded, None, out_tree
        if len(keep) == len(outs):
            return forwarded, self._jit_leaves(), out_tree
        fn = self._fn
        kept = None if self._out is None else [wanted[k] for k in keep]
        rest = jax.jit(lambda s: [jax.tree.leaves(fn(s))[k] for k in keep], out_shardings=kept)
        return forwarded, rest, out_tree

    def _jit_leaves(self):
        return lambda s: jax.tree.leaves(self._jit(s))


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


def _alike(x: jax.Array, want) -> bool:
    """Whether ``x`` is already placed as ``want`` (a sharding) says."""
    try:
        return isinstance(want, jax.sharding.Sharding) and x.sharding.is_equivalent_to(
            want, x.ndim)
    except (ValueError, IndexError):  # a sharding for another rank
        return False
