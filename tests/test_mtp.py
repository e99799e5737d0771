"""DeepSeek-V3's multi-token prediction (fiddlejax.models.mtp): the loss against a hand-written
per-document reference, the Hub's MTP tensors loaded and written back bit-exact, the copies of
the embedding and head checked, and training on expert=2 x data=2 x tensor=2 and on
data=2 x pipe=2 (1F1B), and on data=2 x context=2 x tensor=2 with packed rows, equal to one
device. The checkpoint is the tiny transformers fixture
with an MTP layer written in (transformers drops those weights, so safetensors writes them)."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads
from safetensors.numpy import save_file

import fiddlejax as fj
from fiddlejax import models
from fiddlejax.models.common import Message, scan_layers
from fiddlejax.models.hf import read_safetensors
from fiddlejax.staged import mean_loss

FIXTURE = Path(__file__).parent / "fixtures" / "hf_deepseek_v3"
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def with_mtp(directory: Path, copies_equal: bool = True) -> Path:
    """The fixture plus the Hub's layer ``num_hidden_layers`` (an MTP depth): a block (the
    last layer's tensors, perturbed), its norms and projection, the embedding and head copies."""
    shutil.copytree(FIXTURE, directory)
    tensors = read_safetensors(FIXTURE)
    n = json.loads((FIXTURE / "config.json").read_text())["num_hidden_layers"]
    rng = np.random.default_rng(0)
    d = tensors["model.norm.weight"].shape[0]
    for name, w in list(tensors.items()):
        if name.startswith(f"model.layers.{n - 1}."):
            mine = name.replace(f"layers.{n - 1}.", f"layers.{n}.")
            tensors[mine] = (w + 0.1 * rng.standard_normal(w.shape)).astype(np.float32)
    pre = f"model.layers.{n}."
    tensors[pre + "enorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    tensors[pre + "hnorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    tensors[pre + "shared_head.norm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(
        np.float32)
    tensors[pre + "eh_proj.weight"] = (0.3 * rng.standard_normal((d, 2 * d))).astype(np.float32)
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    if not copies_equal:
        tensors[pre + "shared_head.head.weight"][0, 0] += 1.0
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    return with_mtp(tmp_path_factory.mktemp("mtp") / "m")


def packed_batch(vocab: int, seed: int = 3) -> dict:
    """Two rows of 12 inputs: row 0 three documents (one of 2 tokens), row 1 a document and
    padding; a loss mask dropping some targets."""
    rng = np.random.default_rng(seed)
    seg = np.array([[1] * 5 + [2] * 2 + [3] * 6, [1] * 9 + [0] * 4], np.int32)
    keep = (rng.random(seg.shape) > 0.2).astype(np.int32)
    return {"tokens": rng.integers(1, vocab, seg.shape).astype(np.int32), "segment_ids": seg,
            "loss_mask": keep}


def ce_sum(logits: np.ndarray, targets: np.ndarray, keep: np.ndarray) -> float:
    logits = np.asarray(logits, np.float64)
    z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.sum((z - logits[np.arange(len(targets)), targets]) * keep))


def pad(a, n: int = 12):
    """``a`` padded after its last position (axis 1 of tokens, 0 of activations) to ``n``:
    causal attention and per-token routing leave the earlier positions as they were, and
    one compiled shape serves every document."""
    a = np.asarray(a)
    axis = 1 if a.ndim == 2 and a.dtype.kind == "i" else 0
    width = [(0, 0)] * a.ndim
    width[axis] = (0, n - a.shape[axis])
    return jnp.asarray(np.pad(a, width))


@nnx.jit
def main_hidden(model, doc):
    """The main model's last hidden state after its final norm."""
    return model.norm(scan_layers(model.blocks, model.message(doc)).x)


@nnx.jit
def depth(one, e, h):
    """One MTP depth by hand: ``[enorm(e); hnorm(h)] @ eh_proj``, its block, the head norm."""
    x = jnp.concatenate([one.enorm(e), one.hnorm(h)], -1) @ one.eh_proj[...]
    tally = jnp.zeros((1, x.shape[0], 2 * one.block.config.num_experts + 2))
    x = one.block(Message(x[None], tally=tally)).x[0]
    return x, one.head_norm(x)


def reference_loss(model, batch: dict) -> float:
    """Each document alone, unpacked, through the main model and the MTP depths by hand:
    depth ``k`` reads the document's tokens ``k`` ahead and predicts ``k + 1`` ahead, only
    where both exist; the targets' ``loss_mask`` counts; MTP sums over the main count."""
    c = model.config
    tokens, seg = np.asarray(batch["tokens"]), batch.get("segment_ids")
    keep = batch.get("loss_mask", np.ones_like(tokens))
    seg = np.ones_like(tokens) if seg is None else np.asarray(seg)
    head = np.asarray(model.lm_head[...])
    main, depths, count = 0.0, np.zeros(c.num_nextn_predict_layers), 0.0
    for row in range(tokens.shape[0]):
        for s in set(seg[row].tolist()) - {0}:
            idx = np.nonzero(seg[row] == s)[0]
            doc, kp, n = tokens[row, idx], keep[row, idx], len(idx)
            if n < 2:
                continue
            h = main_hidden(model, pad(doc[None, :-1]))[0, :n - 1]  # [n - 1, d]
            main += ce_sum(np.asarray(h) @ head, doc[1:], kp[1:])
            count += kp[1:].sum()
            for k in range(1, c.num_nextn_predict_layers + 1):
                m = n - k - 1  # positions whose target t_{i+k+1} is in the document
                if m <= 0:
                    break
                graphdef, state = nnx.split(model.mtp)
                one = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], state))
                e = np.asarray(model.embed[...])[doc[k:k + m]]
                h, normed = (a[:m] for a in depth(one, pad(e), pad(h[:m])))
                depths[k - 1] += ce_sum(np.asarray(normed) @ head, doc[k + 1:], kp[k + 1:])
    return (main + c.mtp_loss_weight * depths.mean()) / count


def test_mtp_weights_load_and_round_trip_bit_exact(mtp_dir, tmp_path):
    """The depth is the checkpoint's (the plain fixture: 0); the MTP tensors land in ``mtp``
    and save_pretrained writes every Hub name back with the same bits, the copies included."""
    assert models.from_pretrained(FIXTURE, abstract=True).config.num_nextn_predict_layers == 0
    model = models.from_pretrained(mtp_dir)
    assert model.config.num_nextn_predict_layers == 1
    want = read_safetensors(mtp_dir)
    np.testing.assert_array_equal(np.asarray(model.mtp.eh_proj[...])[0],
                                  want["model.layers.3.eh_proj.weight"].T)
    model.save_pretrained(tmp_path / "out")
    got = read_safetensors(tmp_path / "out")
    assert sorted(got) == sorted(want) and any(k.startswith("model.layers.3.") for k in got)
    assert all(np.array_equal(got[k], want[k]) for k in got)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1


def test_copies_checked_and_depth_overridable(tmp_path):
    """A head copy that differs is refused by name; ``num_nextn_predict_layers=0`` loads the
    main model alone (the MTP tensors left unused, as transformers does)."""
    bad = with_mtp(tmp_path / "bad", copies_equal=False)
    with pytest.raises(ValueError, match="shared_head.head.weight.*differs from lm_head"):
        models.from_pretrained(bad)
    plain = models.from_pretrained(bad, overrides={"num_nextn_predict_layers": 0})
    assert not hasattr(plain, "mtp")
    with pytest.raises(ValueError, match="num_nextn_predict_layers=-1"):
        models.from_pretrained(bad, abstract=True, overrides={"num_nextn_predict_layers": -1})


@pytest.mark.parametrize("packed", [False, True])
def test_loss_equals_per_document_reference(mtp_dir, packed):
    """Ours (packed rows, segment ids, loss mask; or plain windows) equals the reference that
    runs each document alone (rel < 1e-5); the MTP term matters."""
    model = models.from_pretrained(mtp_dir, seq_len=12)
    v = model.config.vocab_size
    batch = packed_batch(v) if packed else {
        "tokens": np.random.default_rng(1).integers(0, v, (2, 13)).astype(np.int32)}
    reported = nnx.jit(lambda m, b: m.loss(m.head(scan_layers(m.blocks, m.prologue(b))), b))(
        model, batch)
    ours, want = float(mean_loss(reported)), reference_loss(model, batch)
    assert abs(ours - want) / abs(want) < 1e-5, (ours, want)
    assert float(reported.means["mtp_loss"]) > 0.1


@pytest.mark.slow  # two 8-device layouts
def test_training_matches_one_device_with_mtp(mtp_dir):
    """Loss (main + MTP) and gradients, the MTP weights' and the shared embedding's and
    head's included, on expert=2 x data=2 x tensor=2 and data=2 x pipe=2 x tensor=2 (1F1B,
    the MTP stack in the head's path), equal one device's (float32, per leaf rel < 1e-5;
    measured: worst leaf 1.0e-6 and 1.2e-6); a pipeline step moves the main router bias and
    holds the MTP block's."""
    model = models.from_pretrained(mtp_dir, seq_len=12)
    batch = packed_batch(model.config.vocab_size)
    batch = {k: np.concatenate([v, v[::-1]]) for k, v in batch.items()}  # 4 rows
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    assert np.all(np.abs(np.asarray(ref_grads["mtp"]["eh_proj"][...])).sum((1, 2)) > 0)
    for plan in (fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2)),
                 fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b",
                         microbatches=2)):
        trainer = fj.parallelize(model, optax.sgd(0.1), plan)
        assert_loss_and_grads(trainer.loss_and_grads(trainer.init(), batch),
                              (ref_loss, ref_grads))
    # a step: the main layers' router bias moves by the loads, the MTP block's is held
    state, metrics = trainer.step(trainer.init(), batch)
    assert float(metrics["mtp_loss"]) > 0.1
    params = trainer.params(state)
    assert np.any(np.asarray(params["blocks"]["moe"]["bias"][...])
                  != np.asarray(model.blocks.moe.bias[...]))
    np.testing.assert_array_equal(np.asarray(params["mtp"]["block"]["moe"]["bias"][...]),
                                  np.asarray(model.mtp.block.moe.bias[...]))


def test_context2_with_packing_and_balance_loss_matches_one_device(mtp_dir):
    """A context split cuts each sequence into chunk rows: the MTP depths read the tokens past
    a chunk (``batch["ahead"]``), their blocks attend over whole sequences, and the
    sequence-wise balance loss pools each sequence's rows. Packed rows with a loss mask on
    data=2 x context=2 x tensor=2 (the ring): loss (main + MTP + balance) and gradients equal
    one device's (float32, per leaf rel < 1e-5), and so do the reported MTP and balance
    losses."""
    model = models.from_pretrained(mtp_dir, seq_len=12, overrides={"router_aux_loss_coef": 0.1})
    batch = packed_batch(model.config.vocab_size)
    batch = {k: np.concatenate([v, v[::-1]]) for k, v in batch.items()}  # 4 rows
    one = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(
        data=1, devices=jax.devices()[:1])))
    split = fj.parallelize(model, optax.sgd(0.1), fj.Plan(
        mesh=fj.make_mesh(data=2, context=2, tensor=2), context_kernel="ring"))
    assert_loss_and_grads(split.loss_and_grads(split.init(), batch),
                          reference_loss_and_grads(model, batch))
    _, want = one.step(one.init(), batch)
    _, got = split.step(split.init(), batch)
    for name in ("mtp_loss", "moe_aux_loss"):
        assert float(want[name]) > 0.01
        np.testing.assert_allclose(float(got[name]), float(want[name]), rtol=1e-5)
