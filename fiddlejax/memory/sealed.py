"""A function an enclosing ``jax.checkpoint`` cannot look into, for layers that must keep
their own checkpoints' policies.

JAX lets an enclosing checkpoint's policy decide every value inside it, nested checkpoints
included. zero=3's layer view needs a checkpoint (its gathered weights must not be saved) but
no policy of its own when the user asked for none; sealing the layer under it keeps what plain
differentiation keeps.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def sealed(f: Callable) -> Callable:
    """``f`` as one step an enclosing ``jax.checkpoint`` cannot look into: its residuals are
    plain differentiation's, so checkpoints inside ``f`` keep their own policies (an outer
    policy would otherwise decide every value inside, e.g. save each MoE block's weight slices
    and activations that the blocked grouped matmul recomputes). Residuals that are
    ``f``'s inputs stay the enclosing computation's values: a gathered weight passed in is
    gathered again by the enclosing checkpoint's backward, not saved."""
    @jax.custom_vjp
    def run(*args):
        return f(*args)

    def fwd(*args):
        return jax.vjp(f, *args)

    def bwd(back, ct):
        return back(ct)

    run.defvjp(fwd, bwd)
    return run


__all__ = ["sealed"]
