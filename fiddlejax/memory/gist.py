"""Gist-style encodings of the activations autodiff stashes for the backward pass.

Gist (Jain et al., ISCA 2018) observed that most training memory is feature maps kept for the
backward pass, and that the backward needs much less than the full values:

- ``relu-1bit``: ReLU's backward needs only the sign of its input: stash a 1-bit mask packed 8 per
  byte (lossless; 32x smaller than an f32 copy, 8x smaller than XLA's ``pred`` mask).
- ``binarize``: ReLU followed by max-pool needs only which input won each window and was positive:
  1 bit per input element (lossless; the pool no longer stashes its f32 input).
- ``bf16`` / ``fp8``: delayed precision reduction: the forward computes in full precision, the input
  a matmul/conv stashes for its weight gradient is stored as bf16 or fp8-e4m3 *bit patterns*
  (``uint16`` / ``uint8``: XLA on CPU silently upcasts bf16 residuals) and decoded in the backward
  (lossy; input gradients stay exact, only weight gradients see the rounding).
- ``sparse`` (``sparse:<capacity>``): a mostly-zero matmul/conv input (a ReLU output) stored as a
  1-bit occupancy mask plus its non-zeros packed into a fixed-capacity buffer of
  ``ceil(capacity * size)`` values. Static shapes force the fixed capacity: it is lossless while the
  density is at most ``capacity``; past it the weight gradient comes out NaN (loud, never silently
  wrong). Opt-in per call: only inputs declared ``relu_input=True`` are stored sparsely.

A model is written once against the model-facing functions :func:`relu`, :func:`relu_maxpool`,
:func:`dense` and :func:`conv`; they use plain ops unless an encoding is selected by the trace-time
context ``with gist.encodings([...]):`` (a ``jax.make_user_context`` value, read while tracing
and part of jax's trace cache keys), or by wrapping the traced function with :func:`with_encodings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ENCODINGS",
    "Encodings",
    "StashCodec",
    "active",
    "binarize",
    "conv",
    "dense",
    "encoded_input",
    "encodings",
    "pack_bits",
    "parse",
    "reduced_precision",
    "relu",
    "relu_1bit",
    "relu_maxpool",
    "sparse_input",
    "unpack_bits",
    "with_encodings",
]

F = TypeVar("F", bound=Callable[..., Any])

ENCODINGS = ("relu-1bit", "binarize", "bf16", "fp8", "sparse")
_ALIASES = {"relu-maxpool-1bit": "binarize"}
DEFAULT_SPARSE_CAPACITY = 0.5

# ---------------------------------------------------------------------------------------------
# Selection: which encodings a trace uses


@dataclasses.dataclass(frozen=True)
class Encodings:
    """A validated set of encodings (hashable: it is static trace-time configuration)."""

    relu_1bit: bool = False
    binarize: bool = False
    precision: str | None = None  # "bf16" | "fp8" | None
    sparse_capacity: float | None = None  # fraction of elements kept, or None

    @property
    def names(self) -> tuple[str, ...]:
        out = []
        if self.relu_1bit:
            out.append("relu-1bit")
        if self.binarize:
            out.append("binarize")
        if self.precision:
            out.append(self.precision)
        if self.sparse_capacity is not None:
            out.append(f"sparse:{self.sparse_capacity:g}")
        return tuple(out)

    def codec_for(self, relu_input: bool) -> StashCodec | None:
        """How :func:`dense` / :func:`conv` store their input, or None for plain autodiff.

        Sparse storage applies only to inputs declared ReLU outputs: elsewhere the density is
        unknown and a fixed capacity would silently drop values.
        """
        cap = self.sparse_capacity if relu_input else None
        if self.precision is None and cap is None:
            return None
        return StashCodec(self.precision, cap)


def parse(names: Iterable[str] | str | Encodings | None) -> Encodings:
    """Validate encoding names (``ENCODINGS``, ``sparse:<capacity>``) into an :class:`Encodings`."""
    if names is None:
        return Encodings()
    if isinstance(names, Encodings):
        return names
    if isinstance(names, str):
        names = [names]
    fields: dict[str, Any] = {}
    for raw in names:
        if not isinstance(raw, str):
            raise ValueError(f"encoding {raw!r} must be a string, one of {ENCODINGS}")
        name = _ALIASES.get(raw, raw)
        if name == "relu-1bit":
            fields["relu_1bit"] = True
        elif name == "binarize":
            fields["binarize"] = True
        elif name in ("bf16", "fp8"):
            if fields.get("precision") not in (None, name):
                raise ValueError(
                    "encodings 'bf16' and 'fp8' both given; a stash has one precision: keep one"
                )
            fields["precision"] = name
        elif name == "sparse" or name.startswith("sparse:"):
            cap = DEFAULT_SPARSE_CAPACITY
            if name != "sparse":
                try:
                    cap = float(name.split(":", 1)[1])
                except ValueError:
                    cap = -1.0
            if not 0.0 < cap < 1.0:
                raise ValueError(
                    f"encoding {raw!r}: the capacity must be a fraction in (0, 1), "
                    "e.g. 'sparse:0.5' (keeps up to half the elements)"
                )
            fields["sparse_capacity"] = cap
        else:
            raise ValueError(
                f"unknown encoding {raw!r}; use any of {ENCODINGS} (or 'sparse:<capacity>')"
            )
    return Encodings(**fields)


_NONE = Encodings()
# A jax user context rather than a bare contextvar: its value is part of every jax tracing and
# compilation cache key, so switching encodings re-traces even a scan body or jitted function
# that was already traced under other encodings (a plain contextvar would hit the stale trace).
_CONTEXT = jax.make_user_context(default_value=None)


def active() -> Encodings:
    """The encodings selected for the trace in progress (none outside ``encodings(...)``)."""
    return _CONTEXT.value or _NONE


@contextlib.contextmanager
def encodings(names: Iterable[str] | str | Encodings | None) -> Iterator[Encodings]:
    """Select encodings for the model-facing functions traced inside this block.

    Tracing caches (``jax.jit``, ``lax.scan`` bodies) are keyed on the selection, so entering it
    around a call of an already-jitted function re-traces that function with the encodings.
    """
    enc = parse(names)
    with _CONTEXT(enc if enc != _NONE else None):
        yield enc


def with_encodings(fn: F, names: Iterable[str] | str | Encodings | None) -> F:
    """``fn`` tracing under ``encodings(names)``: safe to ``jax.jit`` (the context is inside)."""
    enc = parse(names)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with encodings(enc):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Bit packing


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class _Static:
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
# Lossless: ReLU and ReLU + max-pool


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


def _pool_dims(x: jax.Array, window: Sequence[int], strides: Sequence[int] | None):
    window = tuple(int(w) for w in window)
    strides = window if strides is None else tuple(int(s) for s in strides)
    if x.ndim != len(window) + 2 or len(strides) != len(window):
        raise ValueError(
            f"max-pool over {x.shape} with window={window}, strides={strides}: expected "
            f"[batch, *spatial, channels] with one window/stride entry per spatial axis"
        )
    return window, strides


def _max_pool(x: jax.Array, window, strides, padding: str) -> jax.Array:
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
def _binarize(x: jax.Array, window: tuple[int, ...]) -> jax.Array:
    return jnp.maximum(_windows(x, window).max(-1), 0)


def _binarize_fwd(x, window):
    w = _windows(x, window)
    y = jnp.maximum(w.max(-1), 0)
    # The first maximum of each window gets the gradient (as in XLA's select-and-scatter), and
    # only when positive (ReLU). Windows do not overlap, so one bit per element says it all;
    # the bits stay in window order and the cropped border (never in a window) is not stored.
    first = jax.nn.one_hot(jnp.argmax(w, axis=-1), w.shape[-1], dtype=bool)
    return y, (_Static(x.shape), pack_bits(first & (y > 0)[..., None]))


def _binarize_bwd(window, res, g):
    shape, packed = res
    chosen = unpack_bits(packed, (*g.shape, math.prod(window)))
    routed = jnp.where(chosen, g[..., None], jnp.zeros((), g.dtype))
    return (_unwindows(routed, window, shape.value),)


_binarize.defvjp(_binarize_fwd, _binarize_bwd)


def _binarize_applies(x, window, strides, padding) -> bool:
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
    window, strides = _pool_dims(x, window, strides)
    if not _binarize_applies(x, window, strides, padding):
        raise ValueError(
            f"binarize needs non-overlapping VALID windows of a float input; got window={window}, "
            f"strides={strides}, padding={padding!r}, dtype={x.dtype}: use relu_maxpool(), "
            "which falls back to a 1-bit ReLU and a plain max-pool"
        )
    return _binarize(x, window)


# ---------------------------------------------------------------------------------------------
# Lossy / opt-in: how a matmul or conv stores its input


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
        return fn(x, params), (_Static(x.shape), codec.encode(x), params)

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


# ---------------------------------------------------------------------------------------------
# Model-facing functions: plain ops unless the trace selected an encoding


def relu(x: jax.Array) -> jax.Array:
    """ReLU; with ``relu-1bit`` selected its stash is a packed 1-bit mask."""
    return relu_1bit(x) if active().relu_1bit else jax.nn.relu(x)


def relu_maxpool(
    x: jax.Array,
    window: Sequence[int] = (2, 2),
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
) -> jax.Array:
    """Max-pool of ReLU(x) over ``[batch, *spatial, channels]``.

    With ``binarize`` selected and non-overlapping VALID windows the stash is 1 bit per input
    element; otherwise it is ReLU (1-bit if ``relu-1bit`` is selected) followed by a plain max-pool
    (which stashes its f32 input).
    """
    window, strides = _pool_dims(x, window, strides)
    if active().binarize and _binarize_applies(x, window, strides, padding):
        return _binarize(x, window)
    return _max_pool(relu(x), window, strides, padding)


def _matmul(x: jax.Array, params: tuple[jax.Array, jax.Array | None]) -> jax.Array:
    kernel, bias = params
    y = jnp.tensordot(x, kernel, axes=((x.ndim - 1,), (0,)))
    return y if bias is None else y + bias


def dense(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, relu_input: bool = False
) -> jax.Array:
    """``x[..., K] @ kernel[K, ...] (+ bias)``; with ``bf16``/``fp8`` selected the stashed ``x``
    is encoded, and with ``sparse`` too when ``relu_input`` says ``x`` is a ReLU output."""
    codec = active().codec_for(relu_input)
    if codec is None:
        return _matmul(x, (kernel, bias))
    return encoded_input(_matmul, codec)(x, (kernel, bias))


def _conv_fn(strides: tuple[int, ...], padding: Any) -> Callable:
    def f(x, params):
        kernel, bias = params
        k = x.ndim - 2
        spatial = "DHW"[-k:] if k <= 3 else None
        if spatial is None:
            raise ValueError(f"conv supports 1-3 spatial dims, got input shape {x.shape}")
        dn = ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")
        y = jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=dn)
        return y if bias is None else y + bias

    return f


def conv(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    strides: Sequence[int] | None = None,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    *,
    relu_input: bool = False,
) -> jax.Array:
    """Convolution of ``x[N, *spatial, C_in]`` with ``kernel[*window, C_in, C_out]`` (+ bias);
    with ``bf16``/``fp8`` selected the stashed ``x`` is encoded, and with ``sparse`` too when
    ``relu_input`` says ``x`` is a ReLU output."""
    strides = tuple(strides) if strides is not None else (1,) * (x.ndim - 2)
    padding = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)
    f = _conv_fn(strides, padding)
    codec = active().codec_for(relu_input)
    if codec is None:
        return f(x, (kernel, bias))
    return encoded_input(f, codec)(x, (kernel, bias))
