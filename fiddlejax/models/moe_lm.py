"""The smallest language model of mixture-of-experts blocks, in the staged protocol.

Embedding, ``layers`` blocks of ``x + MoE(rmsnorm(x))`` stacked for a scan, a linear head; the
router-loss tally (:mod:`fiddlejax.models.moe_loss`) rides beside the activation in the
layers' message through every block and pipeline stage, and the loss adds the load-balancing
and z-losses. No attention: the expert layouts' tests and
``benchmarks/expert_parallel.py`` measure the MoE layer alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fiddlejax.models import moe_loss
from fiddlejax.models.common import Message, cross_entropy, param, stacked
from fiddlejax.models.moe import MoE, MoEConfig
from fiddlejax.parallel.ops import Ops
from fiddlejax.staged import vocab_parallel


class MoEBlock(nnx.Module):
    """x + MoE(rmsnorm(x)), the router-loss tally carried in the message."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg, self.moe = cfg, MoE(cfg, rngs=rngs)

    def __call__(self, msg: Message, ops: Ops | None = None) -> Message:
        x = msg.x
        h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
        out = self.moe(h, ops=ops)
        return msg._replace(x=x + out.output, tally=moe_loss.accumulate(msg.tally, out))


class MoELM(nnx.Module):
    """``report``: the loss returns ``fj.Reported`` with the router losses as metrics."""

    stack = "blocks"

    def __init__(self, cfg: MoEConfig, vocab: int, layers: int, rngs: nnx.Rngs,
                 report: bool = True):
        self.cfg, self.vocab, self.report = cfg, vocab, report
        normal = jax.nn.initializers.normal(0.5)
        self.embed = param(rngs, normal, (vocab, cfg.hidden_size), ("vocab", "embed"))
        self.blocks = stacked(layers, lambda r: MoEBlock(cfg, r), rngs)
        self.lm_head = param(rngs, normal, (cfg.hidden_size, vocab), ("embed", "vocab"))

    def prologue(self, batch):
        x = jnp.take(self.embed[...], batch["tokens"][:, :-1], axis=0)
        return Message(x, tally=moe_loss.empty(x.shape[:-1], self.cfg.num_experts))

    def head(self, msg: Message):
        return msg.x @ self.lm_head[...], msg.tally

    @vocab_parallel  # its one-hot cross-entropy takes the head's vocabulary-split logits
    def loss(self, outputs, batch):
        logits, tally = outputs
        ce = cross_entropy(logits, batch["tokens"][:, 1:], self.vocab).mean()
        c = self.cfg
        return moe_loss.add_router_losses(ce, tally, c.num_experts_per_tok,
                                          c.router_aux_loss_coef, c.router_z_loss_coef,
                                          report=self.report)
