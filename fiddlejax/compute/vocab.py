"""The embedding and the head split over ``data`` by vocabulary under zero=3, never gathered.

Gathering a float32 embedding or head whole on every device (and its full-size gradient before
the reduce-scatter) is most of a zero=3 step's memory for a small model with a large
vocabulary. Each device keeps instead its slice of the vocabulary and exchanges activations:
the lookup gathers the token ids over ``data``, each device fills the rows its slice holds and
a reduce-scatter hands every replica its own rows (one non-zero term per row: exact); the head
projects every replica's rows onto the local slice, and the cross-entropy joins the slices with
a max and a reduce-scatter of the sums, as Megatron's vocabulary-parallel loss does over
``tensor``. The gradient of each slice is the sum over every replica's rows, as the gathered
weight's reduce-scatter would give.

A model opts in with ``vocab_services = True``: its ``prologue``, ``head`` and ``loss`` take
an ``ops`` argument (:class:`fiddlejax.parallel.ops.Ops`, whose ``vocab`` is a
:class:`VocabShards` under this split, passed by :class:`fiddlejax.compute.ViewedModel`) and
hand it to ``fiddlejax.models.common``'s ``embedding``, ``vocab_rows`` and ``cross_entropy``.
No trace-time channel is involved: the bundled models get it as an argument.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from fiddlejax.memory.storage import from_storage, to_storage


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _every_rows(x: jax.Array, axis: str) -> jax.Array:
    """``x`` all-gathered over ``axis`` on its rows in its own dtype (16-bit floats as their
    bits: a bf16 head input moves and is held at half the bytes of float32), while the
    backward's reduce-scatter sums the cotangents in float32, as gathering a float32 copy
    would (the values are the same either way)."""
    return from_storage(jax.lax.all_gather(to_storage(x), axis, axis=0, tiled=True), x.dtype)


def _every_rows_fwd(x, axis):
    return _every_rows(x, axis), None


def _every_rows_bwd(axis, _, ct):
    summed = jax.lax.psum_scatter(ct.astype(jnp.float32), axis, scatter_dimension=0, tiled=True)
    return (summed.astype(ct.dtype),)


_every_rows.defvjp(_every_rows_fwd, _every_rows_bwd)

@dataclasses.dataclass(frozen=True)
class VocabShards:
    """Vocabulary slices over the manual ``axis``: device ``i`` holds entries
    ``[i * n, (i + 1) * n)`` of each vocabulary axis (``n`` the local size)."""

    axis: str = "data"

    def _offset(self, local: int) -> jax.Array:
        return jax.lax.axis_index(self.axis) * local

    def lookup(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """``take(table, tokens, axis=0)`` of the whole table, from this device's rows
        ``table`` and its replica's ``tokens`` (leading dimension: the rows)."""
        local = table.shape[0]
        index = jax.lax.all_gather(tokens, self.axis, axis=0, tiled=True) - self._offset(local)
        mine = (index >= 0) & (index < local)
        rows = jnp.take(table, jnp.where(mine, index, 0), axis=0)
        rows = jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))
        # summed in float32 (XLA's CPU aborts on a 16-bit reduce-scatter; the gradient's
        # all-gather is the backward's), cast back: one non-zero term, the sum exact
        wide = jax.lax.psum_scatter(rows.astype(jnp.float32), self.axis, scatter_dimension=0,
                                    tiled=True)
        return wide.astype(table.dtype)

    def rows(self, x: jax.Array) -> jax.Array:
        """Every replica's rows of ``x`` (the head's input), for the local vocabulary slice:
        :func:`_every_rows`."""
        return _every_rows(x, self.axis)

    def cross_entropy(self, logits: jax.Array, targets: jax.Array,
                      vocab_size: int) -> jax.Array:
        """Per-position cross-entropy of this replica's rows ``targets`` from every replica's
        ``logits`` over the local vocabulary slice (entries past ``vocab_size``: ignored)."""
        local = logits.shape[-1]
        offset = self._offset(local)
        logits = logits.astype(jnp.float32)
        valid = offset + jnp.arange(local) < vocab_size
        logits = jnp.where(valid, logits, -1e30)
        every = jax.lax.all_gather(targets, self.axis, axis=0, tiled=True)
        top = jax.lax.stop_gradient(jax.lax.pmax(
            jax.lax.stop_gradient(jnp.max(logits, -1)), self.axis))
        sums = jnp.sum(jnp.exp(logits - top[..., None]), -1)
        picked = jnp.sum(logits * jax.nn.one_hot(every - offset, local, dtype=logits.dtype), -1)

        def mine(a):  # this replica's rows, summed over the slices
            return jax.lax.psum_scatter(a, self.axis, scatter_dimension=0, tiled=True)

        rows = targets.shape[0]
        own_top = jax.lax.dynamic_slice_in_dim(top, jax.lax.axis_index(self.axis) * rows, rows)
        return own_top + jnp.log(mine(sums)) - mine(picked)


def vocab_axis(v: nnx.Variable) -> int:
    """The dimension of a parameter named ``vocab`` in its sharding metadata (-1: none)."""
    axes = tuple(v.get_metadata().get("out_sharding") or ())
    return axes.index("vocab") if "vocab" in axes else -1


def splits_vocab(outer_dims: nnx.State, params: nnx.State) -> bool:
    """Whether every outer parameter with a vocabulary axis is sharded over ``data`` on that
    axis (and at least one is): the split :class:`VocabShards` computes with."""
    flat_dims = jax.tree.leaves(outer_dims)
    flat = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    vocab = [(d, vocab_axis(v)) for d, v in zip(flat_dims, flat, strict=True)
             if isinstance(v, nnx.Variable) and vocab_axis(v) >= 0]
    return bool(vocab) and all(d == a for d, a in vocab)


def free_vocab(specs: nnx.State, params: nnx.State, sizes: dict[str, int]) -> nnx.State:
    """``specs`` without the mesh axes of size 1 (``sizes``) on each vocabulary axis (a
    ``tensor`` of 1 shards nothing), so that zero=3 may split the vocabulary over ``data``."""
    def one(spec, v):
        d = vocab_axis(v)
        plain = spec.get_value() if isinstance(spec, nnx.Variable) else spec
        if d < 0 or d >= len(plain) or plain[d] is None:
            return spec
        names = plain[d] if isinstance(plain[d], tuple) else (plain[d],)
        if any(sizes.get(a, 1) > 1 for a in names):
            return spec
        new = P(*(None if i == d else p for i, p in enumerate(plain)))
        return spec.replace(new) if isinstance(spec, nnx.Variable) else new

    return jax.tree.map(one, specs, params,
                        is_leaf=lambda x: isinstance(x, P | nnx.Variable))


__all__ = ["VocabShards", "free_vocab", "splits_vocab", "vocab_axis"]
