"""Dropout whose masks do not depend on the layout: keys from (step, example, layer, site).

A model's ``nnx.Dropout`` draws its mask for a whole array from one RNG stream, so a mask
depends on how the batch is split (data replicas, microbatches) and, once fiddlejax keeps the
stream's state constant, repeats every step. Inside fiddlejax's forward pieces (an adapted
model's prologue, layers and epilogue) the active :func:`keys` context replaces that draw: the
mask of example ``e`` at optimizer step ``s`` in block ``l`` (its ``k``-th dropout call) is drawn
from ``fold_in(fold_in(fold_in(fold_in(base, s), e), l), k)``, row by row. The same example gets
the same mask on every layout and schedule, and a new one at every step; outside that context
(the user's own code) ``nnx.Dropout`` behaves exactly as Flax wrote it. Without keys (validation:
``Trainer.loss``) the context is eval mode: no dropout, as ``deterministic=True``.

The step and each row's global example index enter the batch inside the step
(:func:`with_indices`, keys :data:`STEP` and :data:`EXAMPLE`), so they travel with their rows
through every split of the batch; the per-example keys then travel in the activation message
(:mod:`fiddlejax.adaptation.side_inputs`), with a counter of the blocks run so far.

The bundled models (LoRA dropout, :mod:`fiddlejax.finetune.lora`) take the same keys
explicitly, no context: their prologue folds :func:`example_keys` from the batch's indices
into their message (``Message.keys``), and each layer hands its :class:`LayerKeys` to its
projections as an argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax import intercept

STEP, EXAMPLE = "fiddlejax.step", "fiddlejax.example"
_ORIGINAL = nnx.Dropout.__call__


def with_indices(batch: dict, step: jax.Array) -> dict:
    """``batch`` with each row's optimizer step and global example index (``[B]`` int32)."""
    b = jax.tree.leaves(batch)[0].shape[0]
    return {**batch, STEP: jnp.full((b,), step, jnp.int32), EXAMPLE: jnp.arange(b, dtype=jnp.int32)}


def without_indices(batch: dict) -> dict:
    """``batch`` as the model and the loss see it."""
    return {k: v for k, v in batch.items() if k not in (STEP, EXAMPLE)}


def example_keys(base: jax.Array | int, batch: dict) -> jax.Array | None:
    """Per-example key data ``[B, 2]`` uint32 for the rows of ``batch`` (None: eval mode);
    ``base``: key data, or an int seed (``key(seed)``'s)."""
    if STEP not in batch:
        return None
    if isinstance(base, int):
        base = jax.random.key_data(jax.random.key(base))

    def one(s, e):
        return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(
            jax.random.wrap_key_data(base), s), e))

    return jax.vmap(one)(batch[STEP], batch[EXAMPLE])


class _Keys:
    def __init__(self, data: jax.Array | None, layer):
        self.data, self.layer, self.site = data, layer, 0

    def next(self) -> jax.Array:
        """The next dropout call's per-example keys."""
        self.site += 1
        site = self.site

        layer = jnp.asarray(self.layer, jnp.int32).astype(jnp.uint32)  # -1, -2: the two ends

        def one(k):
            key = jax.random.fold_in(jax.random.wrap_key_data(k), layer)
            return jax.random.fold_in(key, site)

        return jax.vmap(one)(self.data)


@contextlib.contextmanager
def keys(data: jax.Array | None, layer: Any) -> Iterator[None]:
    """``nnx.Dropout`` inside this block draws from per-example ``data`` (``[B, 2]`` key
    data) for block ``layer``; ``data=None``: eval mode, no dropout."""
    with intercept.setting(dropout=_Keys(data, layer)):
        yield


def _call(self, inputs, *, deterministic: bool | None = None, rngs=None):
    ctx = intercept.current().dropout
    if ctx is None:
        return _ORIGINAL(self, inputs, deterministic=deterministic, rngs=rngs)
    det = self.deterministic if deterministic is None else deterministic
    if bool(det) or self.rate == 0 or ctx.data is None:
        return inputs
    if self.rate == 1.0:
        return jnp.zeros_like(inputs)
    if inputs.ndim == 0 or inputs.shape[0] != ctx.data.shape[0]:
        raise ValueError(
            f"a dropout on an array shaped {tuple(inputs.shape)} inside a fiddlejax layer: "
            f"fiddlejax draws dropout masks per example and needs the batch ({ctx.data.shape[0]}"
            " rows) on the leading axis")
    return _masked(inputs, ctx.next(), self.rate, self.broadcast_dims)


def _masked(inputs: jax.Array, keys: jax.Array, rate: float, broadcast_dims=()) -> jax.Array:
    """``inputs`` with row ``e`` masked by a draw from ``keys[e]`` (kept values scaled by
    ``1 / (1 - rate)``)."""
    keep = 1.0 - rate
    shape = list(inputs.shape[1:])
    for d in broadcast_dims:  # the batch axis (0) is never shared: masks are per example
        if d % inputs.ndim:
            shape[d % inputs.ndim - 1] = 1
    mask = jax.vmap(lambda k: jax.random.bernoulli(k, keep, tuple(shape)))(keys)
    mask = jnp.broadcast_to(mask, inputs.shape)
    return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))


@dataclasses.dataclass(frozen=True, eq=False)
class LayerKeys:
    """A bundled model's layer's dropout keys: its message's per-example key
    data ``data [B, 2]`` (:func:`example_keys`) and the layer's index ``layer`` (int32, counted
    by the message). A site (a kernel's name) draws row ``e``'s mask from
    ``fold_in(fold_in(data[e], layer), crc32(site))``: the same on every layout and schedule."""

    data: jax.Array
    layer: jax.Array

    def drop(self, x: jax.Array, site: str, rate: float) -> jax.Array:
        """``x`` (rows first) with this layer's mask of ``site`` at ``rate``."""
        if not rate:
            return x
        if x.ndim == 0 or x.shape[0] != self.data.shape[0]:
            raise ValueError(f"a dropout on an array shaped {tuple(x.shape)}: fiddlejax draws "
                             f"masks per example and needs the batch ({self.data.shape[0]} rows)"
                             " on the leading axis")
        layer = jnp.asarray(self.layer, jnp.int32).astype(jnp.uint32)
        site_id = zlib.crc32(site.encode())

        def one(k):
            key = jax.random.fold_in(jax.random.wrap_key_data(k), layer)
            return jax.random.fold_in(key, site_id)

        return _masked(x, jax.vmap(one)(self.data), rate)


nnx.Dropout.__call__ = _call  # delegates to Flax's own outside a fiddlejax forward piece


def base_key(model: nnx.Module) -> jax.Array:
    """The model's own ``dropout`` RNG stream's key data (``nnx.Rngs(dropout=...)``), else
    ``key(0)``'s: the seed every dropout key is folded from."""
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.RngKey)):
        if "dropout" in map(str, path):  # a stack's (nnx.vmap) keys: its first layer's
            data = jax.random.key_data(v.get_value())
            return data.reshape(-1, data.shape[-1])[0]
    return jax.random.key_data(jax.random.key(0))


def rates(model: nnx.Module) -> list[tuple[str, float]]:
    """``(path, rate)`` of every dropout with a rate above 0."""
    out = []
    for path, m in nnx.iter_graph(model):
        rate = (getattr(m, "rate", 0.0) if isinstance(m, nnx.Dropout)
                else getattr(m, "dropout_rate", 0.0) if isinstance(m, nnx.Module) else 0.0)
        if isinstance(rate, int | float) and rate > 0:
            out.append((".".join(str(p) for p in path) or "the model", rate))
    return out


__all__ = ["EXAMPLE", "STEP", "LayerKeys", "base_key", "example_keys", "keys", "rates",
           "with_indices", "without_indices"]
