# MIT License
#
# Copyright (c) 2022 Andrej Karpathy
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
"""nanoGPT's model.py (karpathy/nanoGPT, MIT), ported line for line from PyTorch to Flax NNX.

Not a byte-for-byte copy: the original is PyTorch, and no download is possible here. The
structure, names and computation are nanoGPT's: ``GPTConfig``; ``CausalSelfAttention`` with a
fused ``c_attn`` (d, 3d) split into q, k, v, heads from a reshape, a causal mask and ``c_proj``;
``MLP`` (``c_fc``, gelu, ``c_proj``); ``Block`` (pre-LayerNorm ``ln_1``/``ln_2``, residuals);
``GPT`` (``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``, ``lm_head`` tied to ``wte``). Left out: the
flash-attention branch, weight init details, ``crop_block_size``, ``from_pretrained``,
``configure_optimizers``, ``estimate_mfu`` and ``generate`` (none is used to train), and the
loss, which nanoGPT computes inside ``forward`` when given targets (returned as logits here).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nnx.Module):
    def __init__(self, config, rngs):
        assert config.n_embd % config.n_head == 0
        self.c_attn = nnx.Linear(config.n_embd, 3 * config.n_embd, use_bias=config.bias, rngs=rngs)
        self.c_proj = nnx.Linear(config.n_embd, config.n_embd, use_bias=config.bias, rngs=rngs)
        self.attn_dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.resid_dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.block_size = config.block_size

    def __call__(self, x):
        B, T, C = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=2)
        k = k.reshape(B, T, self.n_head, C // self.n_head).transpose(0, 2, 1, 3)
        q = q.reshape(B, T, self.n_head, C // self.n_head).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.n_head, C // self.n_head).transpose(0, 2, 1, 3)
        att = (q @ k.swapaxes(-2, -1)) * (1.0 / (k.shape[-1] ** 0.5))
        bias = jnp.tril(jnp.ones((self.block_size, self.block_size)))[None, None]
        att = jnp.where(bias[:, :, :T, :T] == 0, -jnp.inf, att)
        att = jax.nn.softmax(att, axis=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nnx.Module):
    def __init__(self, config, rngs):
        self.c_fc = nnx.Linear(config.n_embd, 4 * config.n_embd, use_bias=config.bias, rngs=rngs)
        self.c_proj = nnx.Linear(4 * config.n_embd, config.n_embd, use_bias=config.bias, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(self, x):
        x = self.c_fc(x)
        x = jax.nn.gelu(x, approximate=False)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nnx.Module):
    def __init__(self, config, rngs):
        self.ln_1 = nnx.LayerNorm(config.n_embd, use_bias=config.bias, rngs=rngs)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln_2 = nnx.LayerNorm(config.n_embd, use_bias=config.bias, rngs=rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nnx.Module):
    def __init__(self, config, rngs):
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(config.block_size, config.n_embd, rngs=rngs)
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        self.h = nnx.List([Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = nnx.LayerNorm(config.n_embd, use_bias=config.bias, rngs=rngs)
        # lm_head shares wte's weights (weight tying): logits = x @ wte.T

    def __call__(self, idx):
        b, t = idx.shape
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = jnp.arange(0, t, dtype=jnp.int32)
        tok_emb = self.wte(idx)
        pos_emb = self.wpe(pos)
        x = self.drop(tok_emb + pos_emb)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = self.wte.attend(x)
        return logits
