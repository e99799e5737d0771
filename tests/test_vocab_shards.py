"""zero=3 keeps a Decoder's embedding and head split by vocabulary over ``data``
(``fiddlejax.compute.vocab``): the step equals one device, and no device holds them whole."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads, tokens

import fiddlejax as fj
from fiddlejax.models.llama import Llama, LlamaConfig

VOCAB, HIDDEN = 512, 16  # the vocabulary the largest dimension, as for real models


def config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=16, tie_word_embeddings=tied)


def trainer(model, **plan):
    return fj.parallelize(model, optax.sgd(1e-2), fj.Plan(
        mesh=fj.make_mesh(data=8), zero=3, **plan))


@pytest.mark.parametrize("tied", [False, True])
def test_loss_and_grads_equal_one_device(tied):
    """Untied: a plain mean; tied (one table, looked up and projected on): packed documents,
    a masked mean over the replicas' targets."""
    model = Llama(config(tied), rngs=nnx.Rngs(0))
    batch = tokens(1, 8, 8, VOCAB)
    if tied:
        seg = np.ones((8, 9), np.int32)
        seg[:, 5:] = 2
        seg[0, 7:] = 0
        batch["segment_ids"] = seg
    t = trainer(model)
    assert t.layout.zero.vocab is not None
    assert_loss_and_grads(t.loss_and_grads(t.init(), batch),
                          reference_loss_and_grads(model, batch))


def test_no_device_holds_the_embedding_or_head_whole():
    """The compiled step's temporaries per device stay below one float32 copy of the embedding
    and head (gathered, they and their gradients were four)."""
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=16)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    whole = 2 * cfg.vocab_size * cfg.hidden_size * 4

    def temp(trainer):
        state = trainer.abstract_state()
        step = trainer.lower_step(state, {"tokens": jax.ShapeDtypeStruct((8, 9), jnp.int32)})
        return step.compile().memory_analysis().temp_size_in_bytes

    split = trainer(model)
    assert split.layout.zero.vocab is not None
    gathered = trainer(model, fsdp_gather="step")  # the control: gathered whole
    assert gathered.layout.zero.vocab is None
    assert temp(split) < whole < temp(gathered)


def test_a_service_offered_to_a_method_without_ops_is_refused():
    """A model that says ``vocab_services = True`` but whose prologue takes no ``ops`` would
    compute with the wrong slices: refused, naming the method and the fix. Other services
    (the context join) reach such a method through the interception, as a layer's block."""
    from fiddlejax.parallel.ops import Ops
    from fiddlejax.staged import _offering

    class Model:
        def prologue(self, batch):
            return batch

    from fiddlejax import intercept

    class Reading:
        def prologue(self, batch):
            return batch, intercept.current().ops

    assert _offering(Model().prologue, None, 1) == 1
    with pytest.raises(TypeError, match=r"Model.prologue takes no `ops`"):
        _offering(Model().prologue, Ops(vocab=object()), 1)
    # other services reach it as they reach a layer's block that takes no ops
    context = Ops(context=object())
    assert _offering(Reading().prologue, context, 1) == (1, context)


def test_bf16_head_rows_gather_16_bits_with_the_same_values(monkeypatch):
    """Under bf16 compute the head's input rows are gathered as 16 bits (half the bytes of the
    float32 copy gathered before), and the loss and gradients are bit for bit those of
    gathering float32: the backward still sums float32."""
    from fiddlejax.compute import vocab

    model = Llama(config(False), rngs=nnx.Rngs(0))
    batch = tokens(2, 8, 8, VOCAB)
    rows = f"[8,8,{HIDDEN}]{{2,1,0}} all-gather"  # every replica's rows: batch x seq x hidden
    t = trainer(model, compute_dtype="bfloat16")
    hlo = t.lower_step(t.abstract_state(), {"tokens": jax.ShapeDtypeStruct(
        (8, 9), jnp.int32)}).compile().as_text()
    forward = [line for line in hlo.splitlines() if "transpose(" not in line]  # the backward's
    assert any(f"u16{rows}" in line for line in forward)  # (the lookup's transpose: float32)
    assert not any(f"f32{rows}" in line for line in forward)
    new = t.loss_and_grads(t.init(), batch)
    monkeypatch.setattr(vocab.VocabShards, "rows", lambda self, x: jax.lax.all_gather(
        x.astype(jnp.float32), self.axis, axis=0, tiled=True).astype(x.dtype))
    t = trainer(model, compute_dtype="bfloat16")
    old = t.loss_and_grads(t.init(), batch)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
