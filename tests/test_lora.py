"""LoRA (fiddlejax.finetune.lora): the adapters' loss and gradients equal one device's on data x
tensor, zero=3 and 1F1B; the base stays frozen and holds no optimizer state."""

from __future__ import annotations

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


def adapted(rank: int = 4) -> Llama:
    """The tiny Llama with adapters whose B is not zero (so A's gradients are not zero)."""
    model = lora.add(Llama(TINY, rngs=nnx.Rngs(0)), lora.LoRA(rank=rank, alpha=2.0 * rank))
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
    with pytest.raises(ValueError, match="dropout=0.1"):
        lora.LoRA(dropout=0.1)
    with pytest.raises(ValueError, match="match no kernel"):
        lora.add(Llama(TINY, rngs=nnx.Rngs(0)), lora.LoRA(targets=("nope",)))
