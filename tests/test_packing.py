"""Packed documents are exact: each document's logits in a packed row equal the document run
alone (GPT and Llama, XLA's mask and the fused path's bias), the packed rows and loss mask are
what docs/data.md says, and a packed batch trains through every pipeline schedule as on one
device."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.data import packing
from fiddlejax.models import common, decoder
from fiddlejax.models.gpt import GPT, GPTConfig
from fiddlejax.models.llama import Llama, LlamaConfig
from tests.helpers import assert_close, assert_loss_and_grads, reference_loss_and_grads, rel_err

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"

V, T = 61, 16


def gpt():
    return GPT(GPTConfig(vocab_size=V, seq_len=T, d_model=32, n_heads=4, n_layers=4, d_ff=64),
               rngs=nnx.Rngs(0))


def llama():
    return Llama(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             seq_len=T), rngs=nnx.Rngs(0))


def two_documents(seed=0, a=7, b=9):
    rng = np.random.default_rng(seed)
    return rng.integers(1, V, a).astype(np.int32), rng.integers(1, V, b).astype(np.int32)


@pytest.mark.parametrize("make", [gpt, llama], ids=["gpt", "llama"])
@pytest.mark.parametrize("fused", [False, True], ids=["mask", "bias"])
def test_packed_row_gives_each_document_its_own_logits(make, fused, monkeypatch):
    forced = functools.partial(common.attention, as_bias=fused)  # every block's attention
    monkeypatch.setattr(common, "attention", forced)
    monkeypatch.setattr(decoder, "attention", forced)
    model = make()
    d1, d2 = two_documents()
    row = np.concatenate([d1, d2])[None]
    seg = np.array([[1] * len(d1) + [2] * len(d2)], np.int32)
    pos = np.array([list(range(len(d1))) + list(range(len(d2)))], np.int32)
    packed = np.asarray(model(row, segment_ids=seg, positions=pos))
    alone1, alone2 = np.asarray(model(d1[None])), np.asarray(model(d2[None]))
    assert_close(packed[0, :len(d1)], alone1[0])
    assert_close(packed[0, len(d1):], alone2[0])
    # positions are derived from the segments when not given
    derived = np.asarray(model(row, segment_ids=seg))
    assert rel_err(derived, packed) < 1e-6
    # without segments the second document would see the first: the test has teeth
    assert rel_err(np.asarray(model(row))[0, len(d1):], alone2[0]) > 1e-3


def test_a_packed_moe_batch_travels_as_int32_ids_and_a_float32_tally():
    """The layers' message of a packed MoE batch under bf16 compute: the activation in bf16,
    segment ids and positions as int32 (no float channels; ids past bf16's exact 256 kept),
    the router tally float32."""
    import jax.numpy as jnp

    from fiddlejax import models

    model = models.from_pretrained(FIXTURES / "hf_mixtral")
    seg = jnp.array([[1, 1, 2, 300, 70000]], jnp.int32)
    pos = jnp.array([[0, 1, 0, 255, 65537]], jnp.int32)
    batch = {"tokens": jnp.zeros((1, 6), jnp.int32),
             "segment_ids": jnp.pad(seg, ((0, 0), (0, 1))),
             "positions": jnp.pad(pos, ((0, 0), (0, 1)))}
    nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    msg = model.prologue(batch)
    assert isinstance(msg, common.Message)
    assert msg.segment_ids.dtype == jnp.int32 and msg.positions.dtype == jnp.int32
    assert np.array_equal(msg.segment_ids, seg) and np.array_equal(msg.positions, pos)
    assert msg.layer is None and msg.tally.dtype == jnp.float32  # one layer type: no index
    assert msg.x.dtype == jnp.bfloat16
    assert msg.x.shape[-1] == model.config.hidden_size  # nothing appended to the activation
    out = common.scan_layers(model.blocks, msg)  # every leaf keeps its dtype through the layers
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, msg)
    assert float(out.tally[..., :model.config.num_experts].sum()) == (
        model.config.num_hidden_layers * model.config.num_experts_per_tok * seg.size)


def test_pack_rows_segments_positions_and_loss_mask():
    docs = [np.array([5, 6, 0]), np.array([7, 8, 9, 0]), np.array([3, 0])]
    rows = packing.pack_rows(docs, 4)
    assert rows["tokens"].tolist() == [[5, 6, 0, 7], [8, 9, 0, 3]]
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 1, 2]]
    assert rows["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]
    # the token after an EOS (a new document) is never a target
    assert packing.loss_mask(rows["segment_ids"]).tolist() == [[True, True, False]] * 2
    pad = packing.pack_rows(docs, 4, pack=False)
    assert pad["tokens"].tolist() == [[5, 6, 0, 0], [7, 8, 9, 0], [3, 0, 0, 0]]
    assert packing.loss_mask(pad["segment_ids"]).tolist() == [
        [True, True, False], [True, True, True], [True, False, False]]


def packed_batch(rows=8, seed=0):
    rng = np.random.default_rng(seed)
    docs = [packing.with_specials(rng.integers(1, V, rng.integers(2, 12)), 0)
            for _ in range(rows * 4)]
    out = packing.pack_rows(docs, T + 1)
    assert len(out["tokens"]) >= rows
    return {k: v[:rows] for k, v in out.items()}


# One schedule of each kind the executor runs (plain, interleaved, V-shaped zero-bubble); the
# tables differ by schedule, the channels that carry segments and positions do not.
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-v"])
def test_packed_batch_through_the_pipeline_equals_one_device(schedule):
    model, batch = llama() if schedule in ("1f1b", "zb-v") else gpt(), packed_batch()
    virtual = 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule=schedule,
                   microbatches=2, virtual_stages=virtual)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def test_padded_batch_masks_padding_out_of_the_loss():
    model = gpt()
    docs = [packing.with_specials(np.arange(1, n), 0) for n in (3, 9, 5, 12)]
    batch = packing.pack_rows(docs, T + 1, pack=False)
    total, count = model.loss(model(batch["tokens"][:, :-1]), batch)
    assert float(count) == sum(n - 1 for n in (3, 9, 5, 12))  # ids and EOS after the first
    rng = np.random.default_rng(1)
    noisy = dict(batch, tokens=np.where(batch["segment_ids"] > 0, batch["tokens"],
                                        rng.integers(1, V, batch["tokens"].shape)))
    assert jax.numpy.allclose(model.loss(model(noisy["tokens"][:, :-1]), noisy)[0], total)
