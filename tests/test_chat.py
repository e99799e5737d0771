"""Chat SFT: conversations rendered as transformers' ``apply_chat_template`` renders them (ids
recorded offline by tests/fixtures/make_chat_fixtures.py on the Llama 3, Qwen3 and Gemma
templates), the assistant's tokens as the only targets (transformers' own assistant mask where
the template marks it), the mask carried by packing and the prepared store as ``loss_mask``,
the loss a masked cross-entropy over the whole global batch, exact on data x tensor and 1F1B."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.data import chat, packing, pipeline, tokenizer
from fiddlejax.data.sources import DataError
from fiddlejax.models.llama import Llama, LlamaConfig
from fiddlejax.staged import mean_loss
from tests.helpers import reference_loss_and_grads, rel_err

CHAT = Path(__file__).parent / "fixtures" / "chat"
EXPECTED = json.loads((CHAT / "expected.json").read_text())
T = 32


def encode_all(family: str, convs=None):
    tok = tokenizer.load(str(CHAT / family))
    tpl = chat.template_of(tok)
    return tok, [chat.encode(c, tok, tpl) for c in convs or EXPECTED["conversations"]]


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma", "generation"])
def test_ids_equal_transformers_apply_chat_template(family):
    tok = tokenizer.load(str(CHAT / family))
    tpl = chat.template_of(tok)
    for conv, want in zip(EXPECTED["conversations"], EXPECTED["families"][family]):
        if "error" in want:  # Gemma's template refuses a system turn, here as there
            with pytest.raises(DataError, match="System role not supported"):
                chat.encode(conv, tok, tpl)
            continue
        text, _ = tpl.assistant_spans(chat.messages(conv))
        assert text == want["text"]
        ids, mask = chat.encode(conv, tok, tpl)
        assert ids.tolist() == want["ids"]
        assert 0 < mask.sum() < len(ids) and ids.dtype == mask.dtype == np.int32


def test_assistant_mask_equals_transformers_with_or_without_generation_blocks():
    """The {% generation %} template: our mask is transformers' ``assistant_masks``, and the
    same template without the blocks (spans found by rendering prefixes) gives the same."""
    tok = tokenizer.load(str(CHAT / "generation"))
    tpl = chat.template_of(tok)
    plain = chat.Template(tpl.source.replace("{%- generation %}", "").replace(
        "{%- endgeneration %}", ""), tpl.variables)
    assert tpl.generation and not plain.generation
    for conv, want in zip(EXPECTED["conversations"], EXPECTED["families"]["generation"]):
        assert chat.encode(conv, tok, tpl)[1].tolist() == want["assistant_masks"]
        assert chat.encode(conv, tok, plain)[1].tolist() == want["assistant_masks"]


def test_assistant_tokens_are_the_answers_and_their_end_of_turn():
    tok, encoded = encode_all("llama3")
    ids, mask = encoded[1]
    said = tok.decode(ids[mask > 0])
    assert said == "Seven.<|eot_id|>Two is the only even prime.<|eot_id|>"
    assert "Name a prime" in tok.decode(ids[mask == 0])


def test_records_and_refusals(tmp_path):
    pc = {"prompt": "hi", "completion": "yo"}
    assert chat.messages(pc) == [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "yo"}]
    with pytest.raises(DataError, match="needs 'messages'"):
        chat.messages({"text": "plain"}, "f.jsonl:3")
    with pytest.raises(DataError, match="has none"):
        chat.template_of(tokenizer.load("bytes"))
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(pc) + "\n")
    from fiddlejax.data import sources

    assert chat.detect(sources.resolve(str(f)), "text") == "chat"
    f.write_text(json.dumps({"text": "x", "messages": []}) + "\n")
    assert chat.detect(sources.resolve(str(f)), "text") == "text"


def test_packing_carries_the_mask_with_the_tokens():
    _, encoded = encode_all("qwen3")
    docs, masks = [e[0] for e in encoded], [e[1] for e in encoded]
    for pack in (True, False):
        rows = packing.pack_rows(docs, T + 1, pack=pack, masks=masks)
        plain = packing.pack_rows(docs, T + 1, pack=pack)
        assert all(np.array_equal(rows[k], plain[k]) for k in plain)
        stream = np.concatenate(masks)[:rows["tokens"].size] if pack else None
        if pack:
            assert np.array_equal(rows["loss_mask"].ravel(), stream)
        assert not rows["loss_mask"][rows["segment_ids"] == 0].any()


def sft_batch(rows=8):
    _, encoded = encode_all("qwen3", EXPECTED["conversations"] * 3)
    b = packing.pack_rows([e[0] for e in encoded], T + 1, masks=[e[1] for e in encoded])
    assert len(b["tokens"]) >= rows
    return {k: v[:rows] for k, v in b.items()}


def llama(layers=2):
    return Llama(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, seq_len=T), rngs=nnx.Rngs(0))


def test_sft_loss_is_the_masked_cross_entropy_by_hand():
    model, batch = llama(), sft_batch()
    out = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))(
        model, batch["tokens"][:, :-1], batch["segment_ids"][:, :-1], batch["positions"][:, :-1])
    logits = np.asarray(out, np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)[..., 0]
    seg, keep = batch["segment_ids"], batch["loss_mask"]
    counted = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0) & (keep[:, 1:] > 0)
    want = nll[counted].mean()
    got = float(mean_loss(model.loss(out, batch)))
    assert abs(got - want) / want < 1e-5
    unmasked = {k: v for k, v in batch.items() if k != "loss_mask"}
    assert abs(float(mean_loss(model.loss(out, unmasked))) - got) > 1e-3
    assert 0 < counted.sum() < (seg[:, 1:] > 0).sum()  # the mask has teeth
    # rows differ in assistant tokens: a mean of per-row (or per-microbatch) means would differ
    per_row = counted.sum(1)
    assert len(set(per_row.tolist())) > 1


@pytest.mark.parametrize("layout", ["data-tensor", "1f1b",
                                    pytest.param("context", marks=pytest.mark.slow)])
def test_sft_exact_across_layouts(layout):
    model, batch = llama(), sft_batch()
    if layout == "context":  # the mask is cut along the sequence with the tokens
        plan = fj.Plan(mesh=fj.make_mesh(data=2, context=2, tensor=2), schedule=None)
    elif layout == "data-tensor":
        plan = fj.Plan(mesh=fj.make_mesh(data=4, tensor=2), schedule=None)
    else:
        plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b",
                       microbatches=2)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    assert abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)) < 1e-5
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert rel_err(g, r) < 1e-5


def test_prepared_store_serves_the_mask(tmp_path):
    data = tmp_path / "chat.jsonl"
    convs = [c for c in EXPECTED["conversations"]] * 6
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    tok = tokenizer.load(str(CHAT / "qwen3"))
    cfg = {"batch_size": 4, "seed": 0, "pack": True, "workers": 0, "path": str(data),
           "cache_dir": str(tmp_path / "cache"), "val_fraction": None, "val_path": str(data)}
    logs = []
    c = pipeline.corpus(str(data), cfg, tok, T, "data.path", log=logs.append)
    assert c.meta["format"] == "chat" and c.meta["loss_mask"]
    _, encoded = encode_all("qwen3", convs)
    want = packing.pack_rows([e[0] for e in encoded], T + 1, masks=[e[1] for e in encoded])
    got = [c.train[i] for i in range(len(c.train))]
    for k in want:
        assert np.array_equal(np.stack([g[k] for g in got]), want[k]), k
    assert c.meta["splits"]["train"]["targets"] == sum(int(e[1].sum()) for e in encoded)
