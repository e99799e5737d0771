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
:func:`dense` and :func:`conv`; they use plain ops unless an encoding is selected, in this order:
their ``encodings`` argument (what the bundled models pass on from ``ops.encodings``: a plan's
``encodings=[...]`` offered to every call, :class:`fiddlejax.parallel.compose.Encoding`); else,
inside a user's unmodified model that fiddlejax traces, the plan's, through the one
interception (:mod:`fiddlejax.intercept`); else the user's own selection for their own code,
``with gist.encodings([...]):`` (a ``jax.make_user_context`` value, read while tracing and part
of jax's trace cache keys; fiddlejax never sets it) or :func:`with_encodings`.

This module is the selection and the model-facing functions; the encodings themselves live in
:mod:`fiddlejax.memory.masks` (the lossless 1-bit ones) and :mod:`fiddlejax.memory.stash`
(reduced precision, sparse), and every name is re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from fiddlejax import intercept
from fiddlejax.memory.masks import (
    binarize,
    binarize_applies,
    binarize_windows,
    max_pool,
    pack_bits,
    pool_dims,
    relu_1bit,
    unpack_bits,
)
from fiddlejax.memory.stash import (
    DEFAULT_SPARSE_CAPACITY,
    StashCodec,
    encoded_input,
    reduced_precision,
    sparse_input,
)

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


def active(explicit: Encodings | None = None) -> Encodings:
    """The encodings for a call: ``explicit`` if given, else a plan's offered to the user's
    model being traced (:mod:`fiddlejax.intercept`), else the user's ``encodings(...)``."""
    if explicit is not None:
        return explicit
    offered = getattr(intercept.current().ops, "encodings", None)
    return offered if offered is not None else (_CONTEXT.value or _NONE)


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
# Model-facing functions: plain ops unless the trace selected an encoding


def relu(x: jax.Array, encodings: Encodings | None = None) -> jax.Array:
    """ReLU; with ``relu-1bit`` selected its stash is a packed 1-bit mask."""
    return relu_1bit(x) if active(encodings).relu_1bit else jax.nn.relu(x)


def relu_maxpool(
    x: jax.Array,
    window: Sequence[int] = (2, 2),
    strides: Sequence[int] | None = None,
    padding: str = "VALID",
    encodings: Encodings | None = None,
) -> jax.Array:
    """Max-pool of ReLU(x) over ``[batch, *spatial, channels]``.

    With ``binarize`` selected and non-overlapping VALID windows the stash is 1 bit per input
    element; otherwise it is ReLU (1-bit if ``relu-1bit`` is selected) followed by a plain max-pool
    (which stashes its f32 input).
    """
    window, strides = pool_dims(x, window, strides)
    enc = active(encodings)
    if enc.binarize and binarize_applies(x, window, strides, padding):
        return binarize_windows(x, window)
    return max_pool(relu(x, enc), window, strides, padding)


def _matmul(x: jax.Array, params: tuple[jax.Array, jax.Array | None]) -> jax.Array:
    kernel, bias = params
    y = jnp.tensordot(x, kernel, axes=((x.ndim - 1,), (0,)))
    return y if bias is None else y + bias


def dense(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, relu_input: bool = False,
    encodings: Encodings | None = None,
) -> jax.Array:
    """``x[..., K] @ kernel[K, ...] (+ bias)``; with ``bf16``/``fp8`` selected the stashed ``x``
    is encoded, and with ``sparse`` too when ``relu_input`` says ``x`` is a ReLU output."""
    codec = active(encodings).codec_for(relu_input)
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
    encodings: Encodings | None = None,
) -> jax.Array:
    """Convolution of ``x[N, *spatial, C_in]`` with ``kernel[*window, C_in, C_out]`` (+ bias);
    with ``bf16``/``fp8`` selected the stashed ``x`` is encoded, and with ``sparse`` too when
    ``relu_input`` says ``x`` is a ReLU output."""
    strides = tuple(strides) if strides is not None else (1,) * (x.ndim - 2)
    padding = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)
    f = _conv_fn(strides, padding)
    codec = active(encodings).codec_for(relu_input)
    if codec is None:
        return f(x, (kernel, bias))
    return encoded_input(f, codec)(x, (kernel, bias))
