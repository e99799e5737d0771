"""How a matmul or conv stores its input for the weight gradient: reduced precision, sparsity.

The forward computes with the exact input; the stash is integer bit patterns (bf16 as ``uint16``,
fp8-e4m3 as ``uint8`` plus a power-of-two scale, and optionally only the non-zeros behind a 1-bit
occupancy mask), decoded in the backward. Input gradients stay exact; only weight gradients see
the rounding. Integer patterns because XLA on CPU silently upcasts bf16 residuals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from fiddlejax.memory.masks import StaticShape, pack_bits, unpack_bits

__all__ = [
    "DEFAULT_SPARSE_CAPACITY",
    "StashCodec",
    "encoded_input",
    "reduced_precision",
    "sparse_input",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SPARSE_CAPACITY = 0.5


@dataclasses.dataclass(frozen=True)
class StashCodec:
    """Encoding of a stashed float array: ``precision`` None/"bf16"/"fp8", optional sparsity."""

    precision: str | None = None
    sparse_capacity: float | None = None

    def __post_init__(self):
        if self.precision not in (None, "bf16", "fp8"):
            raise ValueError(f"precision={self.precision!r} must be None, 'bf16' or 'fp8'")
        cap = self.sparse_capacity
        if cap is not None and not 0.0 < cap <= 1.0:
            raise ValueError(f"sparse_capacity={cap!r} must be a fraction in (0, 1]")

    def encode(self, x: jax.Array) -> Any:
        """The stash for ``x``: integer bit patterns (and indices) only, so XLA keeps them small."""
        if self.sparse_capacity is None:
            return _encode_values(x, self.precision)
        flat = x.reshape(-1)
        mask = flat != 0
        k = max(1, math.ceil(self.sparse_capacity * flat.size))
        pos = jnp.cumsum(mask, dtype=jnp.int32) - 1
        # Non-zeros past the capacity are dropped (index k is out of range: mode="drop"); decode
        # notices from the mask's popcount.
        slot = jnp.where(mask, pos, k)
        vals = jnp.zeros((k,), x.dtype).at[slot].set(flat, mode="drop")
        return pack_bits(mask), _encode_values(vals, self.precision)

    def decode(self, code: Any, shape: Sequence[int], dtype: Any) -> jax.Array:
        if self.sparse_capacity is None:
            return _decode_values(code, self.precision, dtype).reshape(shape)
        packed, vcode = code
        vals = _decode_values(vcode, self.precision, dtype)
        k = vals.shape[0]
        mask = unpack_bits(packed, (math.prod(shape),))
        pos = jnp.cumsum(mask, dtype=jnp.int32) - 1
        out = jnp.where(mask, vals[jnp.clip(pos, 0, k - 1)], jnp.zeros((), dtype))
        # Past capacity the stash lost values: decode to NaN so the weight gradient is loudly
        # wrong rather than silently (input gradients never read the stash and stay exact).
        overflow = pos[-1] >= k
        return jnp.where(overflow, jnp.full((), jnp.nan, dtype), out).reshape(shape)

    def stash_bytes(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """Bytes this codec stores for an array of ``shape`` (the analytic footprint)."""
        n = math.prod(shape)
        per = {None: itemsize, "bf16": 2, "fp8": 1}[self.precision]
        if self.sparse_capacity is None:
            return n * per + (4 if self.precision == "fp8" else 0)
        k = max(1, math.ceil(self.sparse_capacity * n))
        return -(-n // 8) + k * per + (4 if self.precision == "fp8" else 0)


_FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448


def _encode_values(x: jax.Array, precision: str | None) -> Any:
    if precision is None:
        return x
    if precision == "bf16":
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    # fp8-e4m3 saturates to NaN past 448: scale by a power of two (exact) so max|x| fits.
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    exp = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / _FP8_MAX))
    scale = jnp.exp2(exp)
    q = (x.astype(jnp.float32) / scale).astype(_FP8)
    return jax.lax.bitcast_convert_type(q, jnp.uint8), scale


def _decode_values(code: Any, precision: str | None, dtype: Any) -> jax.Array:
    if precision is None:
        return code
    if precision == "bf16":
        return jax.lax.bitcast_convert_type(code, jnp.bfloat16).astype(dtype)
    bits, scale = code
    return (jax.lax.bitcast_convert_type(bits, _FP8).astype(jnp.float32) * scale).astype(dtype)


def encoded_input(fn: F, codec: StashCodec) -> F:
    """``fn(x, params)`` whose backward rebuilds ``x`` from ``codec``'s stash of it.

    The forward runs ``fn`` on the exact ``x``; the backward linearizes ``fn`` at the decoded
    ``x``. For ``fn`` linear in ``x`` and bilinear overall (matmul, conv) the backward's primal
    recomputation is dead code that XLA removes, so the only cost is encode + decode; the input
    gradient is exact and the weight gradient sees the encoding's rounding.
    """

    @jax.custom_vjp
    def f(x, params):
        return fn(x, params)

    def fwd(x, params):
        return fn(x, params), (StaticShape(x.shape), codec.encode(x), params)

    def bwd(res, g):
        shape, code, params = res
        x_hat = codec.decode(code, shape.value, g.dtype)
        _, vjp = jax.vjp(fn, x_hat, params)
        return vjp(g)

    f.defvjp(fwd, bwd)
    return f  # type: ignore[return-value]


def reduced_precision(fn: F, dtype: str = "bf16") -> F:
    """``fn(x, params)`` computed in full precision, ``x`` stashed as ``dtype`` bit patterns."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype={dtype!r} must be 'bf16' or 'fp8'")
    return encoded_input(fn, StashCodec(precision=dtype))


def sparse_input(fn: F, capacity: float = DEFAULT_SPARSE_CAPACITY, precision: str | None = None):
    """``fn(x, params)`` with ``x`` stashed as mask + at most ``ceil(capacity * size)`` non-zeros.

    Lossless while ``x`` has at most that many non-zeros; past it the stash has lost values and
    the gradients that read it (``fn``'s parameter gradients) come out NaN. Pays when
    ``capacity < 1 - 1/32`` for f32 (the mask costs 1/32 of a dense f32 copy).
    """
    return encoded_input(fn, StashCodec(precision=precision, sparse_capacity=capacity))
