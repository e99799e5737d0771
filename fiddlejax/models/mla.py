"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), as transformers' ``DeepseekV3Attention``.

Queries come through a low-rank bottleneck (``q_lora_rank``: ``x -> wq_a -> RMSNorm -> wq_b``)
or one projection (``q_lora_rank`` None). Keys and values share a compressed latent
(``kv_lora_rank``): ``wkv_a`` maps ``x`` to the latent plus one rotary key part
(``qk_rope_head_dim``) shared by every head; the normed latent expands (``wkv_b``) into each
head's un-rotated key part (``qk_nope_head_dim``) and value (``v_head_dim``). A head's query and
key are ``[nope | rope]`` (``qk_head_dim``); its value has its own width. DeepSeek's
checkpoints store the rotary dimensions as interleaved pairs (``rope_interleave``): they are
de-interleaved before the rotate-half RoPE, which leaves every score unchanged.

YaRN (``rope_scaling`` of type ``yarn``) scales cos/sin by its ``attention_factor`` and the
softmax scale ``qk_head_dim ** -0.5`` by ``mscale(factor, mscale_all_dim) ** 2``.

The attention call takes one head width: values narrower than queries are padded with zeros
(the context's padding sliced off), so every kernel and the context-parallel path apply:
under ``context`` the expanded per-head keys and (padded) values travel, not the latent.
Tensor parallelism splits ``heads`` (``wq``/``wq_b``, ``wkv_b``, ``wo``); the latent
projections are replicated over ``tensor``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax.memory import names
from fiddlejax.parallel.ops import Ops

from . import rope
from .common import attention, param, project


class LatentAttention(nnx.Module):
    """``[B, T, d] -> [B, T, d]``; ``config``: a :class:`~.deepseek_config.DeepseekV3Config`."""

    # kernel: (input dims, output dims) (fiddlejax.finetune.lora): the low-rank queries
    # (or the one query projection), the compressed K/V and its expansion, the output
    lora_targets = {"wq_a": (1, 1), "wq_b": (1, 2), "wq": (1, 2), "wkv_a": (1, 1),
                    "wkv_b": (1, 2), "wo": (2, 1)}

    def __init__(self, config, norm, *, rngs: nnx.Rngs, out_std: float = 0.02):
        c = self.config = config
        d, h = c.hidden_size, c.num_attention_heads
        dq, dn, dv = c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
        normal = jax.nn.initializers.normal(0.02)
        if c.q_lora_rank:
            self.wq_a = param(rngs, normal, (d, c.q_lora_rank), ("embed", None))
            self.q_norm = norm(c.q_lora_rank, None)
            self.wq_b = param(rngs, normal, (c.q_lora_rank, h, dq), (None, "heads", "head_dim"))
        else:
            self.wq = param(rngs, normal, (d, h, dq), ("embed", "heads", "head_dim"))
        self.wkv_a = param(rngs, normal, (d, c.kv_lora_rank + c.qk_rope_head_dim),
                           ("embed", None))
        self.kv_norm = norm(c.kv_lora_rank, None)
        self.wkv_b = param(rngs, normal, (c.kv_lora_rank, h, dn + dv),
                           (None, "heads", "head_dim"))
        self.wo = param(rngs, jax.nn.initializers.normal(out_std), (h, dv, d),
                        ("heads", "head_dim", "embed"))

    def rotary(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        """RoPE of the rotary part ``[B, T, H, r]`` (de-interleaved first, as stored)."""
        c = self.config
        if c.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        y = rope.apply_rope(x, c.inv_freq(), positions)
        cos_scale = rope.yarn_factors(c.rope_scaling)[0]
        return y if cos_scale == 1.0 else y * jnp.asarray(cos_scale, y.dtype)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, ops: Ops | None = None) -> jax.Array:
        c = self.config
        dn, dv, r = c.qk_nope_head_dim, c.v_head_dim, c.qk_rope_head_dim
        if c.q_lora_rank:
            q = self.q_norm(project(self, "wq_a", x, "btd,dr->btr"))
            q = project(self, "wq_b", q, "btr,rhk->bthk")
        else:
            q = project(self, "wq", x, "btd,dhk->bthk")
        q = checkpoint_name(q, names.QUERY)
        kv = project(self, "wkv_a", x, "btd,dr->btr")
        latent, k_rot = kv[..., :c.kv_lora_rank], kv[..., c.kv_lora_rank:]
        kv = project(self, "wkv_b", self.kv_norm(latent), "btr,rhk->bthk")
        k_nope = checkpoint_name(kv[..., :dn], names.KEY)
        v = checkpoint_name(kv[..., dn:], names.VALUE)
        q = jnp.concatenate([q[..., :dn], self.rotary(q[..., dn:], positions)], axis=-1)
        k_rot = self.rotary(k_rot[:, :, None, :], positions)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (*k_nope.shape[:3], r))], axis=-1)
        dq = dn + r
        width = max(dq, dv)  # one head width for the attention call: zeros change nothing
        pad = lambda a: a if a.shape[-1] == width else jnp.pad(  # noqa: E731
            a, [(0, 0)] * 3 + [(0, width - a.shape[-1])])
        scale = dq ** -0.5 * rope.yarn_factors(c.rope_scaling)[1]
        ctx = attention(pad(q), pad(k), pad(v), causal=True, segment_ids=segment_ids,
                        scale=scale, ops=ops)[..., :dv]
        return checkpoint_name(project(self, "wo", ctx, "bthk,hkd->btd"), names.ATTN_OUT)
