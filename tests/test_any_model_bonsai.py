"""Any model, round three (issue 50), on the public models themselves: jax-ml/bonsai's ResNet,
Mamba2, Whisper and DINOv3, copied unmodified into ``tests/external`` (README there), each
trained through ``fj.parallelize(..., layers=, loss=)`` and checked against one device's
``jax.value_and_grad`` on data x tensor and on 1F1B (2, 2, 2).

What each one exercises: the ResNet's four stages are unequal blocks (each downsamples and
widens) holding frozen BatchNorm statistics (``use_running_average=True``: read, never
written), each stage its own; Mamba2's blocks differ in an attribute the forward never reads
(``mixer.layer_idx``) and return a tuple (the activation, then their conv and SSM states);
Whisper is an encoder-decoder whose encoder starts with convolutions, pipelined either way;
DINOv3's blocks get a side input built from the batch (its rotary cos/sin)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import types
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx
from test_any_model import check_exact, load

EXTERNAL = Path(__file__).parent / "external"
LAYOUTS = [(4, 1, 2, None, 1, 1), (2, 2, 2, "1f1b", 2, 1)]
IDS = ["data4-tensor2", "1f1b-2x2x2"]


def bonsai(name: str):
    """``tests/external/bonsai_<name>/modeling.py``, imported as ``bonsai_<name>``; jaxtyping,
    which Whisper imports for annotations only, stubbed when not installed."""
    stub = {} if importlib.util.find_spec("jaxtyping") else {
        "jaxtyping": types.SimpleNamespace(Array=jax.Array, DTypeLike=object)}
    sys.modules.update(stub)
    try:
        return load(EXTERNAL / f"bonsai_{name}" / "modeling.py", f"bonsai_{name}")
    finally:
        for n in stub:
            sys.modules.pop(n, None)


def labels_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


@pytest.mark.parametrize(("layout_", "layers"), [(LAYOUTS[0], "layer*"),
                                              (LAYOUTS[1], "layer*.blocks")], ids=IDS)
def test_bonsai_resnet_with_frozen_statistics_exact(layout_, layers):
    """ResNet-50's code at five bottlenecks (``ModelConfig([2, 1, 1, 1])``), BatchNorm
    statistics moved off their init so that each block's own matter (a block reading another's
    would be far off). Its blocks are unequal (the first of each stage downsamples and widens):
    ``layers="layer*"`` names the four stages, ``"layer*.blocks"`` every stage's bottlenecks in
    order, so that a pipeline cuts between any two of them, not only between stages."""
    resnet = bonsai("resnet")
    model = resnet.ResNet(resnet.ModelConfig([2, 1, 1, 1], num_classes=10), rngs=nnx.Rngs(0))
    stats = nnx.state(model, nnx.BatchStat)
    keys = iter(jax.random.split(jax.random.key(5), len(jax.tree.leaves(stats))))
    nnx.update(model, jax.tree_util.tree_map_with_path(
        lambda p, v: v + (0.3 * jax.random.uniform(next(keys), v.shape) if "var" in str(p[-1])
                          else 0.1 * jax.random.normal(next(keys), v.shape)), stats))
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 16, 16, 3)),
             "labels": jax.random.randint(jax.random.key(2), (8,), 0, 10)}
    trainer = check_exact(model, lambda m: m(batch["x"]), labels_ce, batch, layers, layout_)
    first = (("layer0",), ("layer1",)) if layers == "layer*" else (
        ("layer0", "blocks", 0), ("layer0", "blocks", 1))
    assert trainer.staged.block_keys[:2] == first
    assert len(trainer.staged.block_keys) == (4 if layers == "layer*" else 5)


@pytest.mark.parametrize("layout_", LAYOUTS, ids=IDS)
def test_bonsai_mamba2_exact(layout_):
    """Mamba2ForCausalLM (tiny, 4 layers): blocks whose ``layer_idx`` differs and that return
    ``(x, conv_state, ssm_state)``; the activation is the first element, the states (used by
    inference only) are dropped."""
    mamba2 = bonsai("mamba2")
    cfg = dataclasses.replace(mamba2.ModelConfig.tiny(), num_hidden_layers=4, chunk_size=8)
    model = mamba2.Mamba2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    batch = {"input_ids": jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size)}

    def loss_fn(out, b):
        return optax.softmax_cross_entropy_with_integer_labels(
            out["logits"][:, :-1], b["input_ids"][:, 1:]).mean()

    check_exact(model, lambda m: m(batch["input_ids"]), loss_fn, batch, "backbone.layers",
                layout_)


@pytest.fixture(scope="module")
def whisper():
    """bonsai's Whisper, shrunk, under the training forward it leaves to its user (its own
    ``__call__`` raises NotImplementedError): audio features through the encoder, tokens
    through the causal decoder, logits by the tied token embedding."""
    w = bonsai("whisper")
    cfg = dataclasses.replace(
        w.ModelConfig.whisper_tiny(), d_model=32, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2,
        decoder_layers=4, max_source_positions=8, max_length=8, num_mel_bins=6, vocab_size=50)

    class Transcriber(nnx.Module):
        def __init__(self, rngs):
            self.whisper = w.Whisper(cfg, rngs=rngs)

        def __call__(self, input_features, input_ids):
            audio = self.whisper.encoder(input_features)
            mask = nnx.make_causal_mask(input_ids)
            h = self.whisper.decoder(input_ids, mask, audio, None, decode=False)
            return h @ self.whisper.decoder.embed_tokens.embedding[...].T

    batch = {"input_features": jax.random.normal(jax.random.key(1), (8, 16, 6)),
             "input_ids": jax.random.randint(jax.random.key(2), (8, 8), 0, 50)}
    return Transcriber(nnx.Rngs(0)), batch


def tokens_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["input_ids"][:, 1:]).mean()


@pytest.mark.parametrize("stack", ["whisper.decoder.layers", "whisper.encoder.layers"])
@pytest.mark.parametrize("layout_", LAYOUTS, ids=IDS)
def test_bonsai_whisper_either_stack_exact(whisper, stack, layout_):
    """The decoder's blocks pipelined (the encoder, convolutions first, in the prologue; its
    output reaches every decoder block as a side input with its gradient), or the encoder's
    (the decoder in the epilogue): every leaf exact, the convolutions left whole."""
    model, batch = whisper
    check_exact(model, lambda m: m(**batch), tokens_ce, batch, stack, layout_)


@pytest.mark.parametrize("layout_", LAYOUTS, ids=IDS)
def test_bonsai_dinov3_matches_to_its_own_bf16_rounding(layout_):
    """DINOv3's ViT with a classifier on its pooled output. Its rotary embedding casts q and k
    to bfloat16 (``apply_rotary_pos_emb``), so the same math fused differently rounds
    differently: every leaf within bf16's resolution (2^-8) of one device's, where a wrong
    side input or split would be off by far more; the loss within float32's."""
    dinov3 = bonsai("dinov3")
    cfg = dinov3.ModelConfig(patch_size=(4, 4), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=2, image_size=16,
                             num_register_tokens=2, layerscale_value=0.5)

    class Classifier(nnx.Module):
        def __init__(self, rngs):
            self.backbone = dinov3.Dinov3ViTModel(cfg, rngs=rngs)
            self.head = nnx.Linear(cfg.hidden_size, 10, rngs=rngs)

        def __call__(self, pixel_values):
            return self.head(self.backbone(pixel_values)["pooler_output"])

    model = Classifier(nnx.Rngs(0))
    batch = {"pixel_values": jax.random.normal(jax.random.key(1), (8, 3, 16, 16)),
             "labels": jax.random.randint(jax.random.key(2), (8,), 0, 10)}
    tol = {"/".join(map(str, p)): 2.0 ** -8
           for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    check_exact(model, lambda m: m(batch["pixel_values"]), labels_ce, batch, "backbone.layer",
                layout_, leaf_tol=tol)


# git's blob ids of bonsai/models/<name>/modeling.py at commit 36284254cf73 (the README's)
BLOBS = {"resnet": "6f96d0c7b6b09fda69f9b219972519c00c7b54fb",
         "mamba2": "56b3e5ca1638546e2491820fc7ddb8034628b72c",
         "whisper": "88f7c699eb59f84180ebd4436792f03e5b10c37a",
         "dinov3": "d9c6314ec06cc18972271821f605f6e31722242b"}


@pytest.mark.parametrize("name", sorted(BLOBS))
def test_external_bonsai_file_is_the_unmodified_original(name):
    """Byte for byte bonsai's file: its git blob id is the one at the README's commit."""
    data = (EXTERNAL / f"bonsai_{name}" / "modeling.py").read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert blob == BLOBS[name], f"tests/external/bonsai_{name}/modeling.py was modified"
