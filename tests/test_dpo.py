"""DPO (fiddlejax.finetune.dpo, fiddlejax.data.preference): the paper's loss on a hand-computed
example, preference records as one row per example (plain strings and chat messages), and the loss
and gradients of one device reproduced on data x tensor and 1F1B (2, 2, 2), full and LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.data import chat, pipeline, preference, prepare, tokenizer
from fiddlejax.data.sources import DataError
from fiddlejax.finetune import dpo, lora
from fiddlejax.models.llama import Llama, LlamaConfig
from fiddlejax.staged import mean_loss
from tests.helpers import assert_loss_and_grads

QWEN = Path(__file__).parent / "fixtures" / "hf_qwen3_tok"
T = 64
BETA = 0.5


def test_loss_is_the_papers_formula_by_hand():
    # vocab 2, one row: [a, b | a, a] -- segment 1 = prompt a + chosen b, segment 2 = a + a
    logits = np.array([[[0.0, 1.0], [2.0, 0.0], [0.0, 0.0], [1.0, 3.0]]], np.float32)
    batch = {"tokens": np.array([[0, 1, 0, 0, 0]], np.int32),
             "segment_ids": np.array([[1, 1, 2, 2, 0]], np.int32),
             "loss_mask": np.array([[0, 1, 0, 2, 0]], np.int32),
             "ref_chosen": np.array([-0.5], np.float32),
             "ref_rejected": np.array([-1.5], np.float32)}
    # the chosen completion: token 1 after position 0: log softmax([0, 1])[1]
    pi_c = 1.0 - np.log(1.0 + np.e)
    # the rejected one: token 0 after position 2 (logits [0, 0]): log(1/2); position 1's target
    # starts segment 2 and position 3's is padding, so neither counts
    pi_r = np.log(0.5)
    want = -np.log(1.0 / (1.0 + np.exp(-BETA * ((pi_c + 0.5) - (pi_r + 1.5)))))
    c, r = dpo.sequence_logps(logits, batch)
    np.testing.assert_allclose([float(c[0]), float(r[0])], [pi_c, pi_r], rtol=1e-6)
    got = dpo.loss(BETA)(logits, batch)
    assert abs(float(mean_loss(got.value)) - want) < 1e-6
    assert float(got.value[1]) == 1.0  # one example
    with pytest.raises(ValueError, match="beta"):
        dpo.loss(0.0)


def records():
    plain = [{"prompt": f"Add {i} to a.", "chosen": f"a + {i}", "rejected": f"a - {i} {'x' * i}"}
             for i in range(6)]
    conv = [{"prompt": [{"role": "user", "content": f"Name {i}."}],
             "chosen": [{"role": "assistant", "content": f"It is {i}."}],
             "rejected": "No."} for i in range(2)]
    return plain + conv


def test_records_become_one_row_each():
    tok = tokenizer.load(str(QWEN))
    template = chat.template_of(tok)
    plain, conv = records()[0], records()[-1]
    ids, codes = preference.encode(plain, tok, template)
    r = preference.row(ids, codes, T + 1)
    seg, mask = r["segment_ids"], r["loss_mask"]
    c, rj = (seg == 1), (seg == 2)
    assert tok.decode(r["tokens"][mask == dpo.CHOSEN]) == "a + 0" + tok.decode([tok.eos_id])
    assert tok.decode(r["tokens"][mask == dpo.REJECTED]).startswith("a - 0")
    assert tok.decode(r["tokens"][c & (mask == 0)]) == tok.decode(r["tokens"][rj & (mask == 0)])
    assert r["positions"][rj][0] == 0 and r["positions"][rj][1] == 1  # restarts
    # conversational: the chat template renders both; only the completion's turn is scored
    ids, codes = preference.encode(conv, tok, template)
    r = preference.row(ids, codes, 2 * T)
    text = tok.decode(r["tokens"][r["loss_mask"] == dpo.CHOSEN])
    assert "It is 1." in text and "Name" not in text and text.endswith("<|im_end|>")
    whole = chat.encode({"messages": conv["prompt"] + conv["chosen"]}, tok, template)[0]
    assert np.array_equal(r["tokens"][r["segment_ids"] == 1], whole)
    with pytest.raises(DataError, match="model.seq_len"):
        preference.row(ids, codes, 8)
    with pytest.raises(DataError, match="'rejected'"):
        preference.encode({"prompt": "a", "chosen": "b"}, tok, template)


def batch_and_model(with_lora: bool):
    tok = tokenizer.load(str(QWEN))
    template = chat.template_of(tok)
    b = preference.rows([preference.encode(r, tok, template) for r in records()], T + 1)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              seq_len=T), rngs=nnx.Rngs(0))
    ref = dpo.reference(model)
    b = ref(b)
    if with_lora:
        model = lora.add(model, lora.LoRA(rank=4, alpha=8.0))
    # the policy a step away from the reference (else every margin is 0 at the start)
    key, flat = jax.random.key(1), nnx.to_flat_state(nnx.state(model, nnx.Param))
    for path, var in flat:
        if not with_lora or path[-1].endswith("lora_b"):
            key, sub = jax.random.split(key)
            var.set_value(var[...] + 0.05 * jax.random.normal(sub, var.shape, var.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return model, b


@pytest.mark.parametrize("with_lora", [False, True, "in_step"], ids=["full", "lora", "in-step"])
@pytest.mark.parametrize("layout", ["data-tensor", "1f1b"])
def test_dpo_exact_across_layouts(layout, with_lora):
    """in-step: the reference scored by the step on the layout (the base with its adapters off,
    no ``ref_*`` keys in the batch) equals the one-device reference scored beforehand."""
    model, batch = batch_and_model(bool(with_lora))
    loss_fn = dpo.loss(BETA, model.config.vocab_size)
    fed = batch
    if with_lora == "in_step":
        fed = {k: v for k, v in batch.items() if k not in dpo.REF_KEYS}
    if layout == "data-tensor":
        plan = fj.Plan(mesh=fj.make_mesh(data=4, tensor=2), schedule=None)
    else:
        plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=2, tensor=2), schedule="1f1b",
                       microbatches=2)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan, loss=dpo.loss(
        BETA, model.config.vocab_size, in_step=with_lora == "in_step"))
    got = trainer.loss_and_grads(trainer.init(), fed)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def one(p, b):
        logits = forward(nnx.merge(graphdef, p, rest, copy=True), b)
        return mean_loss(loss_fn(logits, b).value)

    want = jax.jit(jax.value_and_grad(one))(params, batch)
    assert float(want[0]) > 0.1
    if with_lora:  # only the adapters train; compare those
        def keep(tree):
            return [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if lora.is_adapter(p)]

        got, want = (got[0], keep(got[1])), (want[0], keep(want[1]))
    assert_loss_and_grads(got, want)


def forward(m, b):
    return m(b["tokens"][:, :-1], segment_ids=b["segment_ids"][:, :-1],
             positions=b["positions"][:, :-1])


def test_loss_starts_at_log_2_and_reports_rewards():
    model, batch = batch_and_model(False)
    logits = nnx.jit(forward)(model, batch)
    c, r = dpo.sequence_logps(logits, batch)
    out = dpo.loss(BETA)(logits, {**batch, "ref_chosen": c, "ref_rejected": r})
    assert abs(float(mean_loss(out.value)) - np.log(2)) < 1e-6  # policy = reference
    assert float(out.means["reward_accuracy"]) == 0.0
    out = dpo.loss(BETA)(logits, batch)  # the perturbed policy against the starting model
    assert 0 < float(out.means["reward_accuracy"]) < float(out.value[1])
    assert float(mean_loss(out.value)) != pytest.approx(np.log(2), abs=1e-3)


def test_context_split_is_refused():
    with pytest.raises(ValueError, match="mesh.context=1"):
        dpo.check_layout(2)


def test_prepared_store_serves_an_example_a_row(tmp_path):
    data = tmp_path / "prefs.jsonl"
    recs = records()
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = tokenizer.load(str(QWEN))
    cfg = {"batch_size": 4, "seed": 0, "pack": True, "workers": 0, "path": str(data),
           "cache_dir": str(tmp_path / "cache"), "val_fraction": None, "val_path": str(data)}
    assert prepare.data_format(str(data), cfg) == "preference"  # detected from the fields
    c = pipeline.corpus(str(data), cfg, tok, T, "data.path", log=lambda _: None)
    assert c.meta["format"] == "preference" and len(c.train) == len(recs)
    want = preference.rows([preference.encode(r, tok, chat.template_of(tok)) for r in recs],
                           T + 1)
    got = [c.train[i] for i in range(len(c.train))]
    for k in want:
        assert np.array_equal(np.stack([g[k] for g in got]), want[k]), k
    with pytest.raises(DataError, match="model.seq_len to at least"):
        pipeline.corpus(str(data), cfg, tok, 16, "data.path", log=lambda _: None)
