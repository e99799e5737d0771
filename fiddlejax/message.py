"""What travels between layers and stages: any pytree of arrays, not only one activation.

A layer maps a message to a message of the same structure, shapes and dtypes: the activation,
and beside it whatever a model needs to carry through the stack (int32 segment ids and
positions of packed documents, float32 router statistics, keys), each leaf in its own dtype.
The pipeline stashes, sends and receives the message leaf by leaf.

A backward moves the message's cotangent through the same buffers. Integer leaves are not
differentiated (JAX gives them ``float0`` cotangents, which no buffer can hold): here their
cotangent is a zero of the leaf's own dtype, converted at the ``vjp`` boundary
(:func:`to_vjp`, :func:`from_vjp`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def differentiable(x) -> bool:
    """Whether a leaf gets a real cotangent (floating point or complex)."""
    return jnp.issubdtype(x.dtype, jnp.inexact)


def zeros(like: Any, lead: tuple[int, ...] = ()) -> Any:
    """Zeros shaped ``(*lead, *leaf.shape)`` in each leaf's dtype."""
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), like)


def cast(msg: Any, like: Any) -> Any:
    """``msg`` with each leaf in the dtype of the matching leaf of ``like``."""
    return jax.tree.map(lambda a, b: a.astype(b.dtype), msg, like)


def where(pred, a: Any, b: Any) -> Any:
    """``a`` where ``pred``, else ``b``, leaf by leaf."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def to_vjp(ct: Any) -> Any:
    """A cotangent as buffers hold it -> as ``jax.vjp``'s function takes it (``float0`` for
    integer leaves)."""
    return jax.tree.map(
        lambda c: c if differentiable(c) else np.zeros(c.shape, jax.dtypes.float0), ct)


def from_vjp(ct: Any, like: Any) -> Any:
    """A cotangent from ``jax.vjp`` -> as buffers hold it (integer leaves: zeros of their
    dtype, varying as ``like`` is under ``shard_map``), each leaf in ``like``'s dtype."""
    return jax.tree.map(
        lambda c, x: c.astype(x.dtype) if differentiable(x) else x * 0,
        ct, like)


def held(ct: Any, dtypes: Any) -> Any:
    """A cotangent as a ``custom_vjp`` backward receives it (``float0`` integer leaves) -> as
    buffers hold it: integer leaves become zeros of their ``dtypes`` leaf, varying over the
    manual axes the real leaves vary over (so a loop can carry them)."""
    real = [c for c in jax.tree.leaves(ct) if c.dtype != jax.dtypes.float0]
    out = jax.tree.map(lambda c, d: c if c.dtype != jax.dtypes.float0 else jnp.zeros(c.shape, d),
                       ct, dtypes)
    return align_varying(out, real)


def _varying(x) -> tuple:
    return tuple(getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", ()))


def align_varying(msg: Any, *others: Any) -> Any:
    """``msg`` with every leaf varying over the manual axes that any leaf of ``msg`` or
    ``others`` varies over (inside ``shard_map``): a loop carrying the message then keeps one
    type, even where a leaf starts as a constant (a statistic's zeros) and a layer makes it
    depend on the batch. A no-op outside ``shard_map``."""
    axes = sorted({a for leaf in jax.tree.leaves((msg, others)) for a in _varying(leaf)})

    def vary(x):
        missing = tuple(a for a in axes if a not in _varying(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(vary, msg) if axes else msg


def describe(msg: Any) -> str:
    """``{name: dtype[shape], ...}`` for errors."""
    flat = jax.tree_util.tree_flatten_with_path(msg)[0]
    return ", ".join(f"{jax.tree_util.keystr(p) or 'message'}: {x.dtype}{list(x.shape)}"
                     for p, x in flat)


def check_layer(layer_out: Any, layer_in: Any) -> None:
    """Refuse a layer whose output message differs from its input's structure, shapes or
    dtypes: a pipeline's buffers are sized once from the message entering the stack."""
    same = (jax.tree.structure(layer_out) == jax.tree.structure(layer_in)
            and all(a.shape == b.shape and a.dtype == b.dtype for a, b in
                    zip(jax.tree.leaves(layer_out), jax.tree.leaves(layer_in))))
    if not same:
        raise ValueError(
            "a layer of the stack must return a message of the structure, shapes and dtypes it "
            f"takes; it takes {{{describe(layer_in)}}} and returns {{{describe(layer_out)}}}: "
            "return every leaf it was given (cast back to its dtype)")


__all__ = ["align_varying", "cast", "check_layer", "describe", "differentiable", "from_vjp",
           "held", "to_vjp", "where", "zeros"]
