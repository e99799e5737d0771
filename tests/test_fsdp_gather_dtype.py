"""FSDP's per-layer gathers in the compute dtype (``ParamView.leaf``): with bf16 compute each
float32 shard is cast first and all-gathered as its 16-bit bits, and its gradient is reduced
in float32 as the float32 gather's transpose, exactly what gathering first and casting after
computes. Paths: ``fsdp_prefetch=False``, data=1 with the shards over context, and the
embedding and head on every path (the prefetching stack: tests/test_prefetch.py)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import BF16 as BF16_TOL
from helpers import assert_loss_and_grads, reference_loss_and_grads, tokens

import fiddlejax as fj
from fiddlejax import compute
from fiddlejax.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fsdp_gather_dtype import collective_bytes, gather_then_cast  # noqa: E402

SEQ = 16
BF16 = "bfloat16"


def llama(hidden=32, ff=64, heads=4):
    return LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=ff,
                       num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=heads // 2, seq_len=SEQ)


@pytest.fixture(scope="module")
def model():
    return Llama(llama(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model):
    """The float32 single-device loss and gradients (jax.value_and_grad)."""
    return reference_loss_and_grads(model, tokens(4, 8, SEQ, 64))


def grads_of(model, plan, batch):
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    return trainer.loss_and_grads(trainer.init(), batch)


@pytest.mark.parametrize("axes,remat", [(dict(data=8), "none"), (dict(data=8), "full"),
                                        (dict(data=1, context=4, tensor=2), "none")])
def test_bf16_loss_and_every_leaf_within_bf16_of_float32(model, reference, axes, remat,
                                                          monkeypatch):
    """zero=3, bf16, each layer gathering its own weights: the loss and every leaf's gradient
    nonzero and within bf16 error (helpers.BF16) of the float32 single-device reference, and
    bitwise what gathering the float32 shards and casting after gives (the cotangent reduced
    in float32 either way)."""
    batch = tokens(4, 8, SEQ, 64)
    plan = dict(mesh=fj.make_mesh(**axes), compute_dtype=BF16, remat=remat, zero=3,
                fsdp_prefetch=False)
    loss, grads = grads_of(model, fj.Plan(**plan), batch)
    assert all(np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
    assert_loss_and_grads((loss, grads), reference, BF16_TOL)
    monkeypatch.setattr(compute.ParamView, "leaf", gather_then_cast)
    loss0, grads0 = grads_of(model, fj.Plan(**plan), batch)
    assert float(loss) == float(loss0)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True):
        assert np.asarray(g).tobytes() == np.asarray(g0).tobytes()


def step_text(model, plan):
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    batch = {"tokens": jax.ShapeDtypeStruct((8, SEQ + 1), jnp.int32)}
    return trainer.lower_step(trainer.abstract_state(), batch).compile().as_text()


def test_gathers_send_16_bits_and_gradients_reduce_in_float32(monkeypatch):
    """The compiled step (data=8, zero=3, bf16, prefetch off): every all-gather carries 16-bit
    elements, half the bytes of gathering float32; every reduce-scatter float32. The embedding
    and head are gathered as the other weights here (split by vocabulary, they exchange
    activations and token ids instead: tests/test_vocab_shards.py)."""
    gathered = type("Gathered", (Llama,), {"vocab_services": False})
    model = nnx.eval_shape(lambda: gathered(llama(), rngs=nnx.Rngs(0)))
    plan = fj.Plan(mesh=fj.make_mesh(data=8), zero=3, compute_dtype=BF16,
                   fsdp_prefetch=False, remat="full")
    now = collective_bytes(step_text(model, plan))
    assert {ty for kind, ty in now if kind == "all-gather"} == {"u16"}, now
    assert {ty for kind, ty in now if kind == "reduce-scatter"} == {"f32"}, now
    monkeypatch.setattr(compute.ParamView, "leaf", gather_then_cast)
    before = collective_bytes(step_text(model, plan))
    assert {ty for kind, ty in before if kind == "all-gather"} == {"f32"}, before
    assert now["all-gather", "u16"] * 2 == before["all-gather", "f32"]
    assert now["reduce-scatter", "f32"] == before["reduce-scatter", "f32"]


def temp_bytes(remat: str) -> int:
    """A step's temp bytes, where one layer's weights (1.9 MiB in bf16) dominate."""
    model = nnx.eval_shape(lambda: Llama(llama(256, 1024, 4), rngs=nnx.Rngs(0)))
    plan = fj.Plan(mesh=fj.make_mesh(data=8), zero=3, compute_dtype=BF16,
                   fsdp_prefetch=False, remat=remat)
    return fj.parallelize(model, optax.sgd(0.1), plan).memory(8)["temp_bytes"]


@pytest.mark.parametrize("remat", ["none", "full"])
def test_gathered_weights_are_not_saved(remat, monkeypatch):
    """A layer's checkpoint refuses the 16-bit gather (a ``custom_vjp_call``) as it refuses
    ``all_gather``: the compiled step holds no more than gathering float32 did."""
    now = temp_bytes(remat)
    monkeypatch.setattr(compute.ParamView, "leaf", gather_then_cast)
    assert now <= temp_bytes(remat)


def test_a_policy_saving_the_gather_would_hold_every_layer(monkeypatch):
    """The control: were the 16-bit gather saveable (as any ``custom_vjp_call`` is to
    ``everything_saveable``), remat none would keep each layer's gathered weights."""
    now = temp_bytes("none")
    monkeypatch.setattr(compute, "_not_saved", lambda prim, params: prim.name in
                        compute._NOT_SAVED)
    layer = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024)  # one layer in bf16, bytes
    assert temp_bytes("none") >= now + layer
