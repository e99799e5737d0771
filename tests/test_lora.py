"""LoRA (fiddlejax.finetune.lora): the adapters' loss and gradients equal one device's on data x
tensor, zero=3 and 1F1B; the base stays frozen and holds no optimizer state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.finetune import lora
from fiddlejax.models.llama import Llama, LlamaConfig
from tests.helpers import reference_loss_and_grads, reference_loss_fn, tokens

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, seq_len=16)


def adapted(rank: int = 4, dropout: float = 0.0) -> Llama:
    """The tiny Llama with adapters whose B is not zero (so A's gradients are not zero)."""
    model = lora.add(Llama(TINY, rngs=nnx.Rngs(0)),
                     lora.LoRA(rank=rank, alpha=2.0 * rank, dropout=dropout), seed=3)
    key, flat = jax.random.key(1), nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        if path[-1].endswith("lora_b"):
            key, sub = jax.random.split(key)
            var.set_value(0.05 * jax.random.normal(sub, var.shape, var.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def mesh_plan(data, pipe, tensor, **kw):
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    return fj.Plan(mesh=mesh, **kw)


def adapters(tree) -> list:
    return [(jax.tree_util.keystr(p), np.asarray(x))
            for p, x in jax.tree_util.tree_leaves_with_path(tree) if lora.is_adapter(p)]


@pytest.fixture(scope="module")
def model_and_reference():
    model = adapted()
    batch = tokens(0, 8, 16, TINY.vocab_size)
    return model, batch, reference_loss_and_grads(model, batch)


@pytest.mark.parametrize("layout", [
    dict(shape=(2, 1, 2), microbatches=2, steps=True),               # data x tensor
    dict(shape=(4, 1, 1), zero=3, steps=False),                      # FSDP
    dict(shape=(2, 2, 1), schedule="1f1b", microbatches=2, steps=False),  # pipeline
])
def test_adapters_loss_and_grads_match_single_device(model_and_reference, layout):
    model, batch, (ref_loss, ref_grads) = model_and_reference
    kw = dict(layout)
    steps = kw.pop("steps")  # (steps on one layout: each compiles for seconds)
    trainer = fj.parallelize(model, optax.adamw(1e-2), mesh_plan(*kw.pop("shape"), **kw))
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)) < 1e-5
    got, want = adapters(grads), adapters(ref_grads)
    assert [k for k, _ in got] == [k for k, _ in want] and len(got) == 2 * 7
    for (k, g), (_, w) in zip(got, want):
        assert np.linalg.norm(w) > 0, k
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5, k
    for p, g in jax.tree_util.tree_leaves_with_path(grads):  # nothing flows into the base
        if not lora.is_adapter(p):
            assert not np.any(np.asarray(g)), jax.tree_util.keystr(p)
    if steps:
        check_steps(trainer, state)


def check_steps(trainer, state):
    # steps move the adapters only; the base keeps its values bit for bit
    before = trainer.params(state)
    for i in range(2):
        state, metrics = trainer.step(state, tokens(i + 1, 8, 16, TINY.vocab_size))
    after = trainer.params(state)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(before)):
        same = np.array_equal(np.asarray(a), np.asarray(b))
        assert same != lora.is_adapter(p), jax.tree_util.keystr(p)
    # no optimizer state for the base
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x)]
    n_adapt, _ = lora.trainable_count(before)
    assert sum(x.size for x in opt_leaves) == 2 * n_adapt  # AdamW: mu and nu


def test_optimizer_state_at_rank_16_is_under_2_percent_of_full():
    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)

    def opt_bytes(with_lora: bool) -> int:
        def build():
            m = Llama(config, rngs=nnx.Rngs(0))
            return lora.add(m, lora.LoRA(rank=16)) if with_lora else m
        model = nnx.eval_shape(build)
        trainer = fj.parallelize(model, optax.adamw(1e-3), mesh_plan(1, 1, 1))
        return sum(x.size * x.dtype.itemsize
                   for x in jax.tree.leaves(trainer.abstract_state().opt_state) if x.ndim)

    full, adapted_ = opt_bytes(False), opt_bytes(True)
    assert adapted_ / full < 0.02, (adapted_, full)


def test_merge_folds_the_adapters_into_the_base():
    model = adapted()
    batch = tokens(3, 2, 16, TINY.vocab_size)
    flat = {".".join(map(str, k)): v.get_value()
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    merged = lora.merge(flat, 2.0)
    plain = Llama(TINY, rngs=nnx.Rngs(0))
    pflat = nnx.to_flat_state(nnx.state(plain, nnx.Param))
    assert sorted(merged) == sorted(".".join(map(str, k)) for k, _ in pflat)
    for k, v in pflat:
        v.set_value(jnp.asarray(merged[".".join(map(str, k))]))
    nnx.update(plain, nnx.from_flat_state(pflat))
    ref_loss = jax.jit(reference_loss_fn(model)[0])(nnx.state(model, nnx.Param), batch)
    got_loss = jax.jit(reference_loss_fn(plain)[0])(nnx.state(plain, nnx.Param), batch)
    assert abs(float(got_loss) - float(ref_loss)) / abs(float(ref_loss)) < 1e-5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rank=0"):
        lora.LoRA(rank=0)
    with pytest.raises(ValueError, match=r"dropout=1\.5 must be in \[0, 1\)"):
        lora.LoRA(dropout=1.5)
    with pytest.raises(ValueError, match="match no kernel"):
        lora.add(Llama(TINY, rngs=nnx.Rngs(0)), lora.LoRA(targets=("nope",)))


class UserBlock(nnx.Module):
    """A user's own block: plain ``nnx.Linear`` layers, two named like attention projections."""

    def __init__(self, d, rngs):
        self.q_proj = nnx.Linear(d, d, rngs=rngs)
        self.v_proj = nnx.Linear(d, d, rngs=rngs)
        self.mlp = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.q_proj(x)) * self.v_proj(x) + 0.1 * self.mlp(x)


class UserLM(nnx.Module):
    def __init__(self, vocab=32, d=16, rngs=None):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([UserBlock(d, rngs) for _ in range(4)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def user_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


@pytest.mark.parametrize("layout", [dict(shape=(2, 1, 2), microbatches=2),
                                    dict(shape=(2, 2, 1), schedule="1f1b", microbatches=2)])
def test_a_users_own_model_gets_adapters_and_trains_only_them(layout):
    """``lora.add`` on a model that declares no ``lora_targets``: its ``nnx.Linear`` layers
    named like the targets become LoRALinear (same kernel and bias), and the adapters' loss and
    gradients equal one device's through ``layers=`` on data x tensor and 1F1B."""
    model = lora.add(UserLM(rngs=nnx.Rngs(0)), lora.LoRA(rank=4, alpha=8.0,
                                                         targets=("q_proj", "v_proj")))
    assert isinstance(model.blocks[0].q_proj, lora.LoRALinear)
    assert type(model.blocks[0].mlp) is nnx.Linear and type(model.out) is nnx.Linear
    key = jax.random.key(1)
    for block in model.blocks:  # B nonzero, so A's gradients are not zero
        for lin in (block.q_proj, block.v_proj):
            key, sub = jax.random.split(key)
            lin.lora.lora_b.set_value(0.05 * jax.random.normal(sub, lin.lora.lora_b.shape))
    k1, k2 = jax.random.split(jax.random.key(2))
    batch = {"tokens": jax.random.randint(k1, (8, 8), 0, 32),
             "labels": jax.random.randint(k2, (8, 8), 0, 32)}
    ref_loss, ref_grads = nnx.value_and_grad(lambda m: user_loss(m(batch["tokens"]), batch))(
        model)
    kw = dict(layout)
    trainer = fj.parallelize(model, optax.adamw(1e-2), mesh_plan(*kw.pop("shape"), **kw),
                             layers="blocks", loss=user_loss)
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)) < 1e-5
    got, want = adapters(grads), adapters(nnx.state(ref_grads, nnx.Param))
    assert [k for k, _ in got] == [k for k, _ in want] and len(got) == 4 * 2 * 2
    for (k, g), (_, w) in zip(got, want):
        assert np.linalg.norm(w) > 0, k
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5, k
    for p, g in jax.tree_util.tree_leaves_with_path(grads):  # nothing flows into the base
        if not lora.is_adapter(p):
            assert not np.any(np.asarray(g)), jax.tree_util.keystr(p)
    before = trainer.params(state)
    state, _ = trainer.step(state, batch)  # the adapters move, the base keeps its bits
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(trainer.params(state)),
                         jax.tree.leaves(before)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) != lora.is_adapter(p)
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x)]
    assert sum(x.size for x in opt_leaves) == 2 * lora.trainable_count(before)[0]


def test_lora_dropout_on_a_users_model_is_layout_independent():
    """LoRA dropout (on the adapters' input) through layers=: deterministic from one key,
    off in eval, new after a step, and the loss and gradients of one device (the same masks)
    on data x tensor and on 1F1B with 4 microbatches. The adapters' gradients get 5e-5: they
    are small sums of large terms of both signs, so the order data=2 reduces them in shows
    (measured on one machine: up to 3.5e-6 without dropout and 1.4e-5 with it over three
    draws of B, where one device with 4 microbatches is within 6e-7); a mask that differed
    would be off by ~1e-2."""
    from helpers import assert_loss_and_grads

    model = lora.add(UserLM(rngs=nnx.Rngs(0)), lora.LoRA(rank=4, dropout=0.3,
                                                         targets=("q_proj", "v_proj")))
    for block in model.blocks:
        for lin in (block.q_proj, block.v_proj):
            lin.lora.lora_b.set_value(0.3 * jnp.ones(lin.lora.lora_b.shape))
    k1, k2 = jax.random.split(jax.random.key(2))
    batch = {"tokens": jax.random.randint(k1, (8, 8), 0, 32),
             "labels": jax.random.randint(k2, (8, 8), 0, 32)}
    results = []
    for layout in [dict(shape=(1, 1, 1), microbatches=1),
                   dict(shape=(2, 1, 2), microbatches=2),
                   dict(shape=(2, 2, 1), schedule="1f1b", microbatches=4)]:
        kw = dict(layout)
        trainer = fj.parallelize(model, optax.sgd(0.1), mesh_plan(*kw.pop("shape"), **kw),
                                 layers="blocks", loss=user_loss)
        state = trainer.init()
        loss, grads = trainer.loss_and_grads(state, batch)
        assert float(trainer.loss_and_grads(state, batch)[0]) == float(loss)
        assert abs(float(trainer.loss(state, batch)) - float(loss)) > 1e-4  # eval: no dropout
        later = trainer.loss_and_grads(dataclasses.replace(state, step=state.step + 1), batch)
        assert abs(float(later[0]) - float(loss)) > 1e-4  # a new mask after a step
        results.append((loss, grads))
    loose = {f"blocks/{i}/{p}/lora/{m}": 5e-5 for i in range(4) for p in ("q_proj", "v_proj")
             for m in ("lora_a", "lora_b")}
    for got in results[1:]:
        assert_loss_and_grads(got, results[0], leaf_tol=loose)


def test_lora_dropout_on_a_bundled_family_is_exact_on_every_layout():
    """LoRA dropout on the decoder families (peft's lora_dropout on the adapters' input): the
    masks come from per-example keys in the message (the batch's step and example index), so
    the loss and every adapter's gradient equal one device's with the same keys on data x
    tensor and on 1F1B with 4 microbatches; deterministic, off in eval, new after a step. A
    family whose layers take no keys (GPT) is refused, naming the key."""
    from fiddlejax.adaptation import dropout
    from fiddlejax.models.gpt import GPT, GPTConfig

    model, batch = adapted(dropout=0.3), tokens(0, 8, 16, TINY.vocab_size)
    want = reference_loss_and_grads(model, dropout.with_indices(batch, jnp.int32(0)))
    evaluated = reference_loss_and_grads(model, batch)[0]  # no keys: no dropout
    assert abs(float(want[0]) - float(evaluated)) > 1e-4
    for layout in [dict(shape=(2, 1, 2), microbatches=2),
                   dict(shape=(2, 2, 1), schedule="1f1b", microbatches=4)]:
        kw = dict(layout)
        trainer = fj.parallelize(model, optax.sgd(0.1), mesh_plan(*kw.pop("shape"), **kw))
        state = trainer.init()
        loss, grads = trainer.loss_and_grads(state, batch)
        assert abs(float(loss) - float(want[0])) / float(want[0]) < 1e-5
        for (k, g), (_, w) in zip(adapters(grads), adapters(want[1]), strict=True):
            assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-5, k
        assert float(trainer.loss_and_grads(state, batch)[0]) == float(loss)
        assert abs(float(trainer.loss(state, batch)) - float(evaluated)) < 1e-5 * float(loss)
        later = trainer.loss_and_grads(dataclasses.replace(state, step=state.step + 1), batch)
        assert abs(float(later[0]) - float(loss)) > 1e-4  # a new mask after a step
    with pytest.raises(ValueError, match=r"context=1, or dropout 0 \(plan\.lora\.dropout=0\)"):
        fj.parallelize(model, optax.sgd(0.1), fj.Plan(
            mesh=fj.make_mesh(data=1, context=2, devices=jax.devices()[:2]), schedule=None))
    gpt = GPT(GPTConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layers=2, seq_len=8),
              rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"plan\.lora\.dropout=0"):
        lora.add(gpt, lora.LoRA(rank=4, dropout=0.1))
