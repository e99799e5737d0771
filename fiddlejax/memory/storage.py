"""Kept 16-bit floats as their bits: how a residual is stored between forward and backward.

XLA's CPU has no 16-bit float arithmetic and widens a bf16 buffer to float32 around the loops
that slice it, so a program that keeps bf16 residuals compiles to twice the bytes a GPU holds.
Stored as ``uint16`` (a bitcast, free on every backend) they stay 16 bits, so the CPU's
``memory_analysis`` measures what a GPU allocates. Used by the pipeline's stash, a full-remat
layer's kept input (:mod:`fiddlejax.memory.remat`) and the prefetching stack's residuals
(:mod:`fiddlejax.compute.prefetch`). Only values no autodiff flows through may be stored so: an
integer has no cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def storage_dtype(dtype) -> jnp.dtype:
    """How a kept residual is stored (the pipeline's stash, a full-remat layer's input): 16-bit
    floats as their bits (``uint16``), so that a backend without native 16-bit arithmetic
    (XLA's CPU) does not convert the whole buffer to float32 around the loops that slice it; a
    bitcast costs nothing anywhere."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if dtype in (jnp.bfloat16, jnp.float16) else dtype


def to_storage(x: jax.Array) -> jax.Array:
    """``x`` as :func:`storage_dtype` stores it."""
    to = storage_dtype(x.dtype)
    return x if to == x.dtype else jax.lax.bitcast_convert_type(x, to)


def from_storage(x: jax.Array, dtype) -> jax.Array:
    """The inverse of :func:`to_storage` for an array of ``dtype``."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


__all__ = ["from_storage", "storage_dtype", "to_storage"]
