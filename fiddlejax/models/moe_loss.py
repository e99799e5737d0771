"""Router losses of a mixture of experts, and how they travel from the layers to the loss.

**Load balancing** (Switch Transformer, as transformers' ``load_balancing_loss_func`` computes
it for Mixtral and Qwen3-MoE): over ``R = layers x tokens`` rows, with ``c_e`` the top-k
choices of expert ``e`` (from the softmax of the router logits) and ``p_e`` its summed softmax
probability, ``aux = E * sum_e (c_e / R) * (p_e / R)``; the model adds
``router_aux_loss_coef * aux`` to the loss.

**Per sequence.** transformers pools ``c`` and ``p`` over the whole batch before the product,
so its value depends on which sequences share a batch: a microbatch or a data shard would get
another one. Here both are pooled per sequence (row) and the product taken per sequence:
``aux_s = E * sum_e c_se * p_se / R_s**2`` with ``R_s = layers x n_s`` (``n_s`` its unmasked
tokens), then averaged over sequences weighted by their loss targets, ``sum_s w_s aux_s /
sum_s w_s`` (plain rows: the plain mean). For one sequence it is transformers' value exactly;
for more it penalises imbalance within each sequence, not only across the batch. It is a sum
over rows, so microbatches and data shards reduce it exactly (:func:`add_router_losses`).

**Router z-loss** (ST-MoE): ``mean_tokens logsumexp(logits)**2`` per layer, summed over layers,
per sequence as above, coefficient ``router_z_loss_coef`` (0: off).

**Transport: the tally.** Every token carries a float32 *tally* of ``2E + 2`` values in the
layers' message (``Message.tally``, beside the activation): its choice counts per expert, its
summed softmax probabilities per expert, its summed ``logsumexp**2`` and its dropped choices,
accumulated over the layers it went through. Each MoE layer adds its own (:func:`accumulate`);
the head hands the tally to the loss, which reduces it per sequence (:func:`sequence_losses`).
Only per-token sums travel, so every layout and schedule sees the same numbers; the
probabilities and z keep their gradients, so the router learns from the aux loss through the
pipeline's backward. The tally stays float32 whatever the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fiddlejax.staged import Reported

from .moe import MoEOutput


def width(num_experts: int) -> int:
    """Channels of the tally: counts ``[E]``, probabilities ``[E]``, z, dropped."""
    return 2 * num_experts + 2


def empty(lead: tuple[int, ...], num_experts: int, dtype=jnp.float32) -> jax.Array:
    """A zero tally ``[*lead, 2E + 2]`` for the prologue's message."""
    return jnp.zeros((*lead, width(num_experts)), dtype)


def layer_tally(out: MoEOutput) -> jax.Array:
    """One layer's float32 contribution ``[..., 2E + 2]`` to each token's tally."""
    logits = out.router_logits.astype(jnp.float32)
    e = logits.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(out.experts, e, dtype=jnp.float32), axis=-2)
    probs = jax.nn.softmax(logits, axis=-1)
    z = jnp.square(jax.nn.logsumexp(logits, axis=-1))[..., None]
    dropped = out.dropped.astype(jnp.float32)[..., None]
    return jnp.concatenate([jax.lax.stop_gradient(counts), probs, z,
                            jax.lax.stop_gradient(dropped)], axis=-1)


def accumulate(tally: jax.Array, out: MoEOutput) -> jax.Array:
    """``tally`` plus this layer's contribution (in float32, returned in the tally's dtype)."""
    return (tally.astype(jnp.float32) + layer_tally(out)).astype(tally.dtype)


class RouterLosses(NamedTuple):
    """Per-sequence router losses ``[B]`` from a tally, and the dropped choices."""

    aux: jax.Array      # load balancing, transformers' formula on each sequence
    z: jax.Array        # router z-loss: mean over tokens, summed over layers
    dropped: jax.Array  # choices dropped by capacity, summed over tokens and layers


def sequence_losses(tally: jax.Array, top_k: int, mask: jax.Array | None = None,
                    sequences: Callable | None = None) -> RouterLosses:
    """:class:`RouterLosses` of a tally ``[B, T, 2E + 2]``; ``mask [B, T]`` leaves tokens out
    (padding, as transformers' ``attention_mask``). A row with no token gets zeros.
    ``sequences`` joins per-row sums into their sequences' when a layout cut each sequence
    into several rows (``context``: :meth:`fiddlejax.parallel.context.Joining.sequences`)."""
    join = sequences or (lambda a: a)
    t = tally.astype(jnp.float32)
    e = (t.shape[-1] - 2) // 2
    if mask is not None:
        t = t * mask.astype(jnp.float32)[..., None]
    s = join(jnp.sum(t, axis=-2))                    # [B, 2E + 2]
    counts, probs, z, dropped = s[:, :e], s[:, e:2 * e], s[:, 2 * e], s[:, 2 * e + 1]
    rows = jax.lax.stop_gradient(jnp.sum(counts, -1) / top_k)  # layers x tokens
    n = join(jnp.full(t.shape[:1], t.shape[-2], jnp.float32) if mask is None
             else jnp.sum(mask.astype(jnp.float32), -1))
    safe = jnp.maximum(rows, 1.0)
    aux = jnp.where(rows > 0, e * jnp.sum(counts * probs, -1) / jnp.square(safe), 0.0)
    zs = jnp.where(n > 0, z / jnp.maximum(n, 1.0), 0.0)
    return RouterLosses(aux, zs, dropped)


def add_router_losses(value, tally: jax.Array, top_k: int, aux_coef: float,
                      z_coef: float = 0.0, mask: jax.Array | None = None,
                      weights: jax.Array | None = None, report: bool = False,
                      sequences: Callable | None = None):
    """A language-model loss ``value`` with the router losses added, exactly reducible:

    - a scalar mean (plain rows): ``value + aux_coef * mean_s aux_s + z_coef * mean_s z_s``;
    - a pair ``(sum, count)`` (packed or padded rows): ``(sum + sum_s w_s (aux_coef * aux_s +
      z_coef * z_s), count)`` with ``w_s`` = ``weights[s]``, each row's loss targets, whose
      sum is ``count``: the row losses averaged with the token weights of the pair.

    ``report=True`` returns a ``fiddlejax.staged.Reported``: the step's metrics then hold
    ``moe_aux_loss`` (the load-balancing loss before its coefficient, averaged over sequences
    as the loss is), ``moe_z_loss`` (when ``z_coef`` is on) and ``moe_dropped`` (the choices
    capacity dispatch dropped in the whole batch, summed over layers). ``sequences``: as
    :func:`sequence_losses` takes it (each sequence's ``weights`` then the sum of its rows').
    """
    r = sequence_losses(tally, top_k, mask, sequences)
    if sequences is not None and weights is not None:
        weights = sequences(weights)
    per_row = aux_coef * r.aux + z_coef * r.z
    if isinstance(value, tuple | list):
        total, count = value
        if weights is None:
            raise ValueError("a (sum, count) loss needs weights=: each row's count of loss "
                             "targets (summing to count), to weight its router losses")
        w = jax.lax.stop_gradient(weights)
        value, mean = (total + jnp.sum(per_row * w), count), lambda a: jnp.sum(a * w)
    else:
        value, mean = value + jnp.mean(per_row), jnp.mean
    if not report:
        return value
    means = {"moe_aux_loss": mean(r.aux), **({"moe_z_loss": mean(r.z)} if z_coef else {})}
    return Reported(value, means, {"moe_dropped": jnp.sum(r.dropped)})


def load_balancing_loss(router_logits: Sequence[jax.Array], num_experts: int, top_k: int,
                        mask: jax.Array | None = None) -> jax.Array:
    """transformers' ``load_balancing_loss_func``: one value for the whole batch, from each
    layer's ``[tokens, E]`` logits (``mask``: ``[tokens]``). The reference the per-sequence
    loss equals on one sequence; not reducible over microbatches."""
    counts = jnp.zeros((num_experts,), jnp.float32)
    probs = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    m = None if mask is None else mask.reshape(-1).astype(jnp.float32)
    for logits in router_logits:
        p = jax.nn.softmax(logits.reshape(-1, num_experts).astype(jnp.float32), axis=-1)
        hot = jnp.sum(jax.nn.one_hot(jax.lax.top_k(p, top_k)[1], num_experts), axis=-2)
        w = jnp.ones(p.shape[:1], jnp.float32) if m is None else m
        counts += jnp.sum(hot * w[:, None], 0)
        probs += jnp.sum(p * w[:, None], 0)
        rows += jnp.sum(w)
    return num_experts * jnp.sum((counts / rows) * (probs / rows))
