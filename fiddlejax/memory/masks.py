"""Lossless 1-bit stashes: ReLU keeps a packed sign mask, ReLU + max-pool keeps one bit per input.

Gist's observation (Jain et al., ISCA 2018): ReLU's backward needs only the sign of its input,
and ReLU followed by a non-overlapping max-pool needs only which input won each window and was
positive. Both are ``jax.custom_vjp`` functions whose residual is bits packed 8 per byte; their
gradients are bit-identical to plain autodiff's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "StaticShape",
    "binarize",
    "binarize_applies",
    "binarize_windows",
    "max_pool",
    "pack_bits",
    "pool_dims",
    "relu_1bit",
    "unpack_bits",
]


# ---------------------------------------------------------------------------------------------
# Bit packing


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StaticShape:
    """A static shape carried through custom_vjp residuals as pytree structure, not as data."""

    value: tuple[int, ...]

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, aux, _):
        return cls(aux)


_SHIFTS = np.arange(8, dtype=np.uint8)


def pack_bits(mask: jax.Array) -> jax.Array:
    """A boolean array as ``uint8[ceil(size / 8)]``, 8 elements per byte (little bit order)."""
    flat = mask.reshape(-1).astype(jnp.uint8)
    pad = (-flat.size) % 8
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return jnp.sum(flat.reshape(-1, 8) << _SHIFTS, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Inverse of :func:`pack_bits`: a boolean array of ``shape``."""
    n = math.prod(shape)
    bits = (packed[:, None] >> _SHIFTS) & jnp.uint8(1)
    return bits.reshape(-1)[:n].reshape(shape).astype(bool)


# ---------------------------------------------------------------------------------------------
# ReLU and ReLU + max-pool


@jax.custom_vjp
def relu_1bit(x: jax.Array) -> jax.Array:
    """ReLU whose backward stash is a 1-bit packed mask of ``x > 0`` (same gradient as
    ``jax.nn.relu``, including 0 at 0)."""
    return jnp.maximum(x, 0)


def _relu_1bit_fwd(x):
    return jnp.maximum(x, 0), pack_bits(x > 0)


def _relu_1bit_bwd(packed, g):
    return (jnp.where(unpack_bits(packed, g.shape), g, jnp.zeros_like(g)),)


relu_1bit.defvjp(_relu_1bit_fwd, _relu_1bit_bwd)


def pool_dims(x: jax.Array, window: Sequence[int], strides: Sequence[int] | None):
    """``(window, strides)`` as int tuples (strides default to the window), checked against x."""
    window = tuple(int(w) for w in window)
    strides = window if strides is None else tuple(int(s) for s in strides)
    if x.ndim != len(window) + 2 or len(strides) != len(window):
        raise ValueError(
            f"max-pool over {x.shape} with window={window}, strides={strides}: expected "
            f"[batch, *spatial, channels] with one window/stride entry per spatial axis"
        )
    return window, strides


def max_pool(x: jax.Array, window, strides, padding: str) -> jax.Array:
    """A plain max-pool over the spatial axes (autodiff stashes its input)."""
    dims = (1, *window, 1)
    step = (1, *strides, 1)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, step, padding)


def _windows(x: jax.Array, window: tuple[int, ...]) -> jax.Array:
    """``[N, *spatial, C]`` (cropped to whole windows) as ``[N, *out, C, prod(window)]``."""
    n, c = x.shape[0], x.shape[-1]
    out = [s // w for s, w in zip(x.shape[1:-1], window, strict=True)]
    x = x[(slice(None), *[slice(0, o * w) for o, w in zip(out, window, strict=True)])]
    shape = [n]
    for o, w in zip(out, window, strict=True):
        shape += [o, w]
    x = x.reshape(*shape, c)
    k = len(window)
    outer = [1 + 2 * i for i in range(k)]
    inner = [2 + 2 * i for i in range(k)]
    return x.transpose(0, *outer, 2 * k + 1, *inner).reshape(n, *out, c, math.prod(window))


def _unwindows(w: jax.Array, window: tuple[int, ...], full: Sequence[int]) -> jax.Array:
    """Inverse of :func:`_windows`, zero-filling the cropped border up to ``full`` shape."""
    k = len(window)
    n, out, c = w.shape[0], w.shape[1 : 1 + k], w.shape[1 + k]
    x = w.reshape(n, *out, c, *window)
    perm = [0]
    for i in range(k):
        perm += [1 + i, 2 + k + i]
    x = x.transpose(*perm, 1 + k).reshape(n, *[o * s for o, s in zip(out, window, strict=True)], c)
    pad = [(0, 0)] + [(0, f - o * s) for f, o, s in zip(full[1:-1], out, window, strict=True)]
    return jnp.pad(x, pad + [(0, 0)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def binarize_windows(x: jax.Array, window: tuple[int, ...]) -> jax.Array:
    """:func:`binarize` without its checks: the caller made sure it applies."""
    return jnp.maximum(_windows(x, window).max(-1), 0)


def _binarize_fwd(x, window):
    w = _windows(x, window)
    y = jnp.maximum(w.max(-1), 0)
    # The first maximum of each window gets the gradient (as in XLA's select-and-scatter), and
    # only when positive (ReLU). Windows do not overlap, so one bit per element says it all;
    # the bits stay in window order and the cropped border (never in a window) is not stored.
    first = jax.nn.one_hot(jnp.argmax(w, axis=-1), w.shape[-1], dtype=bool)
    return y, (StaticShape(x.shape), pack_bits(first & (y > 0)[..., None]))


def _binarize_bwd(window, res, g):
    shape, packed = res
    chosen = unpack_bits(packed, (*g.shape, math.prod(window)))
    routed = jnp.where(chosen, g[..., None], jnp.zeros((), g.dtype))
    return (_unwindows(routed, window, shape.value),)


binarize_windows.defvjp(_binarize_fwd, _binarize_bwd)


def binarize_applies(x, window, strides, padding) -> bool:
    """Whether :func:`binarize` can pool ``x`` (non-overlapping VALID windows, float input)."""
    return tuple(strides) == tuple(window) and padding == "VALID" and jnp.issubdtype(
        x.dtype, jnp.floating
    )


def binarize(
    x: jax.Array,
    window: Sequence[int] = (2, 2),
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
) -> jax.Array:
    """Max-pool of ReLU(x) whose stash is 1 bit per input element (Gist's Binarize).

    ``x`` is ``[batch, *spatial, channels]``. Needs non-overlapping windows (``strides`` equal to
    ``window``, ``padding="VALID"``); other pools raise ``ValueError``.
    """
    window, strides = pool_dims(x, window, strides)
    if not binarize_applies(x, window, strides, padding):
        raise ValueError(
            f"binarize needs non-overlapping VALID windows of a float input; got window={window}, "
            f"strides={strides}, padding={padding!r}, dtype={x.dtype}: use relu_maxpool(), "
            "which falls back to a 1-bit ReLU and a plain max-pool"
        )
    return binarize_windows(x, window)
