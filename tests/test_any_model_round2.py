"""Any model, round two (issue 37): nanoGPT (``tests/external/nanogpt``, MIT) with Megatron names
on a tensor-split pipeline (it hung: run in a subprocess with a timeout), inputs shifted only when
declared, side inputs without a batch axis, dropout with layout-independent masks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads
from test_any_model import check_exact, load, plan_for

import fiddlejax as fj

NANOGPT = Path(__file__).parent / "external" / "nanogpt" / "model.py"
MEGATRON = {r"attn/c_attn/kernel": ("embed", "heads"), r"attn/c_attn/bias": ("heads",),
            r"attn/c_proj/kernel": ("heads", "embed"), r"mlp/c_fc/kernel": ("embed", "mlp"),
            r"mlp/c_fc/bias": ("mlp",), r"mlp/c_proj/kernel": ("mlp", "embed")}


def nanogpt(dropout=0.0, n_layer=2):
    gpt = load(NANOGPT, "nanogpt_model")
    cfg = gpt.GPTConfig(block_size=8, vocab_size=64, n_layer=n_layer, n_head=2, n_embd=16,
                        dropout=dropout)
    return gpt.GPT(cfg, rngs=nnx.Rngs(0, dropout=1))


def token_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


TOKENS = {"tokens": jax.random.randint(jax.random.key(0), (8, 9), 0, 64)}

HANG = """
import os, sys
sys.path.insert(0, {tests!r})
import conftest  # 8 simulated devices
from test_any_model_round2 import *
model = nanogpt(n_layer={n_layer})
fj.sharding.annotate(model, MEGATRON)
check_exact(model, lambda m: m(TOKENS["tokens"][:, :-1]), fj.next_token(token_ce), TOKENS,
            "h", {layout!r})
print("EXACT")
"""


@pytest.mark.parametrize("layout_", [(2, 2, 2, "1f1b", 2, 1), (4, 1, 2, None, 1, 1),
                                     (2, 2, 2, "interleaved-1f1b", 2, 2)],
                         ids=["pipe-tensor-1f1b", "data-tensor", "pipe-tensor-interleaved"])
def test_nanogpt_megatron_names_exact_and_never_hangs(layout_):
    """The hang of issue 37: GSPMD's collective-permutes (the fused q|k|v split) inside a
    stage's layer loop. A subprocess with a timeout, so that a regression fails, never hangs."""
    tests = str(Path(__file__).parent)
    n_layer = layout_[1] * layout_[5] if layout_[5] > 1 else 2  # a layer a chunk
    code = textwrap.dedent(HANG.format(tests=tests, layout=layout_, n_layer=n_layer))
    env = {**os.environ, "PYTHONPATH": tests}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=400, env=env, cwd=tests)
    except subprocess.TimeoutExpired:
        pytest.fail(f"nanoGPT on {layout_} hung (over 400 s)")
    assert "EXACT" in out.stdout, out.stderr[-3000:]
    if layout_[3] is not None:  # the fused split is found and the loops run in lockstep
        assert "collective-permute" in out.stderr and "lockstep" in out.stderr


def test_inferred_names_leave_fused_attention_whole_and_say_so():
    model = nanogpt()
    with pytest.warns(UserWarning, match=r"inferred them .*row-parallel .*h/\*/mlp/c_proj/kernel"):
        named = fj.sharding.infer_names(model)
    assert "h/0/mlp/c_fc/kernel" in named and "h/0/attn/c_attn/kernel" not in named
    assert "h/0/attn/c_proj/kernel" not in named  # its split would reach the fused q|k|v


def test_inferred_names_without_an_embedding():
    """A ViT-like model (a patch projection, no ``embedding``): q/k/v/out and the MLP split."""
    class Encoder(nnx.Module):
        def __init__(self, rngs):
            self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
            self.linear1 = nnx.Linear(16, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    class ViT(nnx.Module):
        def __init__(self, rngs):
            self.projection = nnx.Conv(3, 16, kernel_size=(2, 2), strides=(2, 2), rngs=rngs)
            self.layers = nnx.List([Encoder(rngs) for _ in range(2)])
            self.classifier = nnx.Linear(16, 10, rngs=rngs)

    with pytest.warns(UserWarning, match=r"model width 16\): 20 of 28"):
        named = fj.sharding.infer_names(ViT(nnx.Rngs(0)))
    assert named["layers/1/attention/query/kernel"] == ("embed", "heads", "head_dim")
    assert named["layers/0/linear2/kernel"] == ("mlp", "embed")
    assert "classifier/kernel" not in named  # 10 classes: whole


def test_a_rank3_convolution_is_not_read_as_attention():
    """Whisper's encoder stem (issue 50): a Conv1d kernel ``[3, in, d]`` has attention's rank
    and ends in the width, yet is no ``[heads, head_dim, embed]``: it stays whole (with 3
    input channels it would be refused as "n_heads=3 not divisible by tensor")."""
    class Stem(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(3, 16, kernel_size=(3,), rngs=rngs)
            self.attention = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)
            self.linear1 = nnx.Linear(16, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    with pytest.warns(UserWarning, match="inferred them"):
        named = fj.sharding.infer_names(Stem(nnx.Rngs(0)))
    assert "conv1/kernel" not in named and "conv1/bias" not in named
    assert named["attention/out/kernel"] == ("heads", "head_dim", "embed")


# -- 2: inputs are shifted only when declared ------------------------------------------------
class Classifier(nnx.Module):
    """Takes the whole ``tokens`` (a classifier with a ``label`` key)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.out(x.mean(1))


def label_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def test_tokens_key_is_given_whole():
    batch = {**TOKENS, "label": jnp.arange(8) % 3}
    for layout_ in [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1)]:
        check_exact(Classifier(nnx.Rngs(0)), lambda m: m(batch["tokens"]), label_ce, batch,
                    "blocks", layout_)


def test_undeclared_shift_is_refused_by_the_models_own_check():
    trainer = fj.parallelize(nanogpt(), optax.sgd(0.1), plan_for((8, 1, 1, None, 1, 1)),
                             loss=token_ce, layers="h")  # 9 tokens, block_size 8, no shift
    with pytest.raises(ValueError, match=r"fails on a batch shaped \{'idx': \(1, 9\)\}.*"
                                         r"fj.next_token"):
        trainer.loss_and_grads(trainer.init(), {"idx": TOKENS["tokens"]})


# -- 3: side inputs without a batch axis -------------------------------------------------------
class Rotary(nnx.Module):
    """Blocks given rotary tables (S, d/2) and a (1, 1, S, S) mask, as GPT-OSS passes them."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])

    def __call__(self, inputs, scale):
        s = inputs.shape[1]
        freqs = jnp.arange(s)[:, None] * (1.0 / 10 ** jnp.arange(8))[None]  # (S, d/2)
        cos, sin = jnp.cos(freqs), jnp.sin(freqs)
        mask = jnp.tril(jnp.ones((s, s), bool))[None, None]  # (1, 1, S, S)
        x = self.embed(inputs)
        for b in self.blocks:
            x = x + b(_rotate(x, cos, sin, mask) * scale[:, None, None])
        return x @ self.embed.embedding[...].T


def _rotate(x, cos, sin, mask):
    a, b = x[..., :8], x[..., 8:]
    y = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)
    w = jnp.where(mask[0, 0], 1.0, 0.0) / mask[0, 0].sum(-1, keepdims=True)
    return w @ y


def test_side_inputs_without_a_batch_axis_pass_whole():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x, cos, sin, mask, scale):
            return x + self.lin(_rotate(x, cos, sin, mask) * scale[:, None, None])

    class Model(Rotary):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])

        def __call__(self, inputs, scale):
            s = inputs.shape[1]
            freqs = jnp.arange(s)[:, None] * (1.0 / 10 ** jnp.arange(8))[None]
            cos, sin = jnp.cos(freqs), jnp.sin(freqs)
            mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
            x = self.embed(inputs)
            for b in self.blocks:
                x = b(x, cos, sin, mask, scale)
            return x @ self.embed.embedding[...].T

    batch = {"inputs": TOKENS["tokens"][:, :-1], "targets": TOKENS["tokens"][:, 1:],
             "scale": jnp.linspace(0.5, 1.5, 8)}

    def loss(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    for layout_ in [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1),
                    (2, 2, 2, "interleaved-1f1b", 2, 2)]:
        check_exact(Model(nnx.Rngs(0)), lambda m: m(batch["inputs"], batch["scale"]), loss,
                    batch, "blocks", layout_)


# -- 5: dropout ---------------------------------------------------------------------------------
def test_dropout_masks_equal_on_every_layout_and_new_every_step():
    check_dropout(nanogpt(dropout=0.2, n_layer=2), fj.next_token(token_ce), TOKENS, "h")


def check_dropout(model, loss, batch, layers):
    """From one key the loss is deterministic, differs from eval mode and after a step, and
    two layouts that split the batch differently agree (loss and gradients)."""
    results = []
    for layout_ in [(4, 1, 2, None, 2, 1), (2, 2, 2, "1f1b", 4, 1)]:
        trainer = fj.parallelize(model, optax.sgd(0.1), plan_for(layout_), loss=loss,
                                 layers=layers)
        state = trainer.init()
        loss1, grads = trainer.loss_and_grads(state, batch)
        again, _ = trainer.loss_and_grads(state, batch)
        assert float(again) == float(loss1)  # the same key: deterministic
        assert abs(float(trainer.loss(state, batch)) - float(loss1)) > 1e-4  # eval: no dropout
        later, _ = trainer.loss_and_grads(dataclasses.replace(state, step=state.step + 1), batch)
        assert abs(float(later) - float(loss1)) > 1e-4  # a new mask after a step
        results.append((loss1, grads))
    (a, ga), (b, gb) = results
    assert_loss_and_grads((b, gb), (a, ga))


def test_bonsai_gpt_oss_rotary_tables_and_mask_pass_whole():
    """jax-ml/bonsai's GPT-OSS (``tests/external/bonsai_gpt_oss``, unmodified): its blocks get
    rotary tables ``(S, d/2)`` and an additive ``(1, 1, S, S)`` mask built in ``__call__``, no
    batch axis; it failed on every layout with a broadcasting error from inside JAX."""
    oss = load(Path(__file__).parent / "external" / "bonsai_gpt_oss" / "modeling.py",
               "bonsai_gpt_oss_modeling")
    cfg = oss.GptOssConfig(vocab_size=64, hidden_size=16, intermediate_size=8,
                           num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    model = oss.GptOssForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)  # its experts start at zero: give them values
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    nnx.update(model, jax.tree.unflatten(tdef, [
        0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]))
    batch = {"input_ids": TOKENS["tokens"]}

    def ce(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, b["input_ids"][:, 1:]).mean()

    for layout_ in [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1)]:
        check_exact(model, lambda m: m(batch["input_ids"][:, :-1]),
                    fj.next_token(ce, "input_ids"), batch, "model.layers", layout_)


def test_bonsai_vit_gets_tensor_parallelism_without_an_embedding():
    """jax-ml/bonsai's ViT (``tests/external/bonsai_vit``, unmodified) has no vocabulary
    embedding: its attention and MLP matrices are split over ``tensor`` by their block
    structure, the log says so, and it is exact (its required ``rngs=`` given as None)."""
    vit = load(Path(__file__).parent / "external" / "bonsai_vit" / "modeling.py",
               "bonsai_vit_modeling")
    cfg = vit.ModelConfig(image_size=(8, 8), patch_size=(4, 4), num_channels=3, hidden_dim=16,
                          attn_dropout_prob=0.0, dropout_prob=0.0, num_heads=2, mlp_dim=32,
                          eps=1e-6, num_layers=2, num_labels=10)
    model = vit.ViTClassificationModel(cfg, rngs=nnx.Rngs(0))
    batch = {"x": jax.random.normal(jax.random.key(0), (8, 8, 8, 3)), "label": jnp.arange(8) % 10}
    with pytest.warns(UserWarning, match=r"model width 16\): (\d+) of \d+ parameters split"):
        named = fj.sharding.infer_names(model)
    assert named["layers/0/attention/query/kernel"] == ("embed", "heads", "head_dim")
    assert named["layers/1/linear1/kernel"] == ("embed", "mlp")
    assert named["layers/1/linear2/kernel"] == ("mlp", "embed")

    def ce(logits, b):
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()

    for layout_ in [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1)]:
        check_exact(model, lambda m: m(batch["x"], rngs=None), ce, batch, "layers", layout_)


def test_warnings_point_at_the_users_call():
    """The inferred-names warning names the caller's file and line, not a library frame
    (computed from the stack, not a hand-counted ``stacklevel``)."""
    class Stem(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(16, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 16, rngs=rngs)

    with pytest.warns(UserWarning, match="inferred them") as caught:
        fj.sharding.infer_names(Stem(nnx.Rngs(0)))
    assert {Path(w.filename).name for w in caught} == {Path(__file__).name}
