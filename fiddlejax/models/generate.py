"""Text generation for the bundled decoders (GPT, every Hugging Face family) with a KV cache.

The prompt runs once (prefill) and fills each layer's keys and values; every new token then
runs one position through the stack, attending to the cache, instead of re-running the whole
sequence. ``use_cache=False`` re-runs the full (padded) sequence per token: the reference the
tests compare against (greedy decoding gives the same tokens). Sampling: ``temperature=0`` is
greedy; otherwise softmax at ``temperature`` restricted to the ``top_p`` nucleus.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .decoder import DecoderBlock


def _cached_context(q, k_cache, v_cache, start, window=None, softcap=None, scale=None,
                    sinks=None):
    """Attention of queries ``q[B, T]`` at ``start`` over the cache (keys up to their own
    position, within ``window``; scores soft-capped, and ``sinks[H]`` in the softmax, as the
    model does)."""
    b, t, h, dh = q.shape
    s, kv = k_cache.shape[1], k_cache.shape[2]
    qpos, kpos = (start + jnp.arange(t))[:, None], jnp.arange(s)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if softcap is None and sinks is None:
        return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None],
                                            scale=scale)
    qg = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k_cache) * (dh ** -0.5 if scale is None
                                                             else scale)
    scores = scores if softcap is None else softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask, scores, -jnp.inf)
    if sinks is not None:  # GPT-OSS: one more column per head, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(scores.dtype).reshape(1, kv, h // kv, 1, 1),
                                (*scores.shape[:-1], 1))
        scores = jnp.concatenate([scores, sink], -1)
    probs = jax.nn.softmax(scores, axis=-1)[..., :s].astype(v_cache.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache).reshape(b, t, h, dh)


def _update(cache, new, start):
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, start, 0, 0))


def _decoder_step(block, x, k_cache, v_cache, start, positions, layer):
    """One decoder layer (any family) over ``x`` at ``start``, its cache updated."""
    c = block.config

    def attend(h, kc, vc, kind):
        q, k, v = block.qkv(h, positions, kind)
        kc, vc = _update(kc, k, start), _update(vc, v, start)
        sinks = getattr(block, "sinks", None)  # GPT-OSS's, and its output bias
        ctx = _cached_context(q, kc, vc, start, c.window(kind), c.attn_logit_softcapping,
                              c.attention_scale, None if sinks is None else sinks[...])
        out = jnp.einsum("bthk,hkd->btd", ctx, block.wo[...])
        return (out + block.bo[...] if hasattr(block, "bo") else out), kc, vc

    branches = [lambda h, kc, vc, kind=kind: attend(h, kc, vc, kind) for kind in c.kinds]
    table = jnp.asarray([c.kinds.index(t) for t in c.layer_types], jnp.int32)
    a, k_cache, v_cache = jax.lax.switch(table[layer], branches, block.attn_norm(x), k_cache,
                                         v_cache)
    return block.residual(x, a), k_cache, v_cache


def _block_step(block, x, k_cache, v_cache, start, positions, layer):
    if isinstance(block, DecoderBlock):
        return _decoder_step(block, x, k_cache, v_cache, start, positions, layer)
    h = block.ln1(x)
    q = jnp.einsum("btd,dhk->bthk", h, block.wq[...])
    k = jnp.einsum("btd,dhk->bthk", h, block.wk[...])
    v = jnp.einsum("btd,dhk->bthk", h, block.wv[...])
    k_cache, v_cache = _update(k_cache, k, start), _update(v_cache, v, start)
    ctx = _cached_context(q, k_cache, v_cache, start)
    x = x + jnp.einsum("bthk,hkd->btd", ctx, block.wo[...]) + block.bo[...]
    return x + block.mlp(block.ln2(x)), k_cache, v_cache


def _forward(model, tokens, cache, start):
    """Logits of ``tokens[B, T]`` placed at ``start``, and the updated cache."""
    t = tokens.shape[1]
    positions = jnp.broadcast_to(start + jnp.arange(t), tokens.shape)
    if hasattr(model, "wpe"):  # GPT: learned positions
        x = jnp.take(model.wte[...], tokens, axis=0) + jnp.take(model.wpe[...], positions, 0)
    else:  # a decoder: its embedding (scaled for Gemma)
        x = model.embed_tokens(tokens)
    graphdef, state = nnx.split(model.blocks)
    layers = jnp.arange(cache[0].shape[0])

    def body(h, layer):
        layer_state, kc, vc, i = layer
        h, kc, vc = _block_step(nnx.merge(graphdef, layer_state), h, kc, vc, start, positions, i)
        return h, (kc, vc)

    x, (ks, vs) = jax.lax.scan(body, x, (state, cache[0], cache[1], layers))
    return model.head(x), (ks, vs)


def empty_cache(model, batch: int, length: int):
    """Zero keys and values ``[layers, batch, length, kv_heads, head_dim]``."""
    wk = model.blocks.wk[...]  # [layers, d, kv_heads, head_dim]
    shape = (wk.shape[0], batch, length, wk.shape[2], wk.shape[3])
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def max_length(model) -> int:
    c = model.config
    return getattr(c, "seq_len", None) if hasattr(model, "wpe") else c.max_position_embeddings


def sample(logits: jax.Array, key, temperature: float, top_p: float) -> jax.Array:
    """Next ids ``[B]`` from logits ``[B, V]``: greedy at temperature 0, else nucleus."""
    if temperature <= 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, -1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), -1)
        keep = jnp.cumsum(probs, -1) - probs < top_p  # the smallest set reaching top_p
        cut = jnp.where(keep, jnp.take_along_axis(logits, order, -1), -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[
            jnp.arange(logits.shape[0])[:, None], order].set(cut)
    return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def generate(model, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             use_cache: bool = True) -> np.ndarray:
    """``prompt[B, P]`` (int) continued by up to ``max_new_tokens`` ids: ``[B, P + n]``
    (stops early once every row has produced ``eos_id``). A model without a K/V cache here
    (DeepSeek-V3's latent attention) runs its full forward for every new token instead."""
    use_cache = use_cache and hasattr(model.blocks, "wk")
    prompt = np.asarray(prompt, np.int32)
    b, p = prompt.shape
    total = p + max_new_tokens
    limit = max_length(model)
    if total > limit:
        raise ValueError(f"prompt of {p} tokens + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's {limit} positions; shorten them")
    key = jax.random.key(seed)
    out = np.zeros((b, total), np.int32)
    out[:, :p] = prompt
    if use_cache:
        step = nnx.jit(_forward, static_argnums=())
        logits, cache = step(model, jnp.asarray(prompt), empty_cache(model, b, total), 0)
        last = logits[:, -1]
    else:
        full = nnx.jit(lambda m, t: m(t))
    done = np.zeros(b, bool)
    for i in range(p, total):
        if not use_cache:
            last = full(model, jnp.asarray(out))[:, i - 1]  # causal: later zeros do not count
        key, sub = jax.random.split(key)
        nxt = np.asarray(sample(last, sub, temperature, top_p))
        out[:, i] = np.where(done, eos_id if eos_id is not None else 0, nxt)
        done |= eos_id is not None and (nxt == eos_id)
        if done.all():
            return out[:, :i + 1]
        if use_cache and i + 1 < total:
            logits, cache = step(model, jnp.asarray(out[:, i:i + 1]), cache, i)
            last = logits[:, -1]
    return out
