"""Generation with a KV cache equals generation without (greedy), for GPT and Llama; the cached
logits equal the full forward's; `fiddlejax eval`, `fiddlejax generate` and `init_from` work from
a run and from a Hugging Face directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fiddlejax.models import generate as gen
from tests.helpers import rel_err
from tests.test_packing import gpt, llama


@pytest.mark.parametrize("make", [gpt, llama], ids=["gpt", "llama"])
def test_kv_cache_matches_the_full_forward(make):
    model = make()
    prompt = np.random.default_rng(0).integers(1, 61, (2, 5))
    cached = gen.generate(model, prompt, 8)
    assert np.array_equal(cached, gen.generate(model, prompt, 8, use_cache=False))
    # logits of the cached prefill + one decode step == the full forward at those positions
    cache = gen.empty_cache(model, 2, 13)
    first, cache = gen._forward(model, jnp.asarray(cached[:, :12]), cache, 0)
    step, _ = gen._forward(model, jnp.asarray(cached[:, 12:13]), cache, 12)
    full = np.asarray(model(jnp.asarray(cached)))
    assert rel_err(np.asarray(first), full[:, :12]) < 1e-5
    assert rel_err(np.asarray(step), full[:, 12:13]) < 1e-5
    sampled = gen.generate(model, prompt, 8, temperature=0.8, top_p=0.9, seed=3)
    assert np.array_equal(sampled, gen.generate(model, prompt, 8, temperature=0.8, top_p=0.9,
                                                seed=3))
    with pytest.raises(ValueError, match="exceeds the model's"):
        gen.generate(model, prompt, 5000)


SMALL = ["model.seq_len=32", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
         "model.n_layers=2", "model.d_ff=64", "data.batch_size=8", "run.cpu_devices=2",
         "mesh.data=2", "mesh.pipe=1", "mesh.tensor=1", "plan.schedule=null",
         "plan.microbatches=1", "train.eval_every=0", "train.eval_batches=2",
         "run.progress=lines"]


def cli(*args):
    r = subprocess.run([sys.executable, "-m", "fiddlejax.cli", *args], capture_output=True,
                       text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


@pytest.mark.slow
def test_eval_generate_and_init_from(tmp_path):
    from tests.test_data_sources import stdlib_docs

    docs = stdlib_docs(80)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = [f"data.path={tmp_path / 'c.jsonl'}", f"data.tokenizer={tmp_path / 'tokenizer.json'}"]
    run = tmp_path / "run"
    code, out = cli("train", "model.name=llama", *SMALL, *data, "train.steps=6", f"run.dir={run}")
    assert code == 0, out[-3000:]

    code, out = cli("eval", f"run.dir={run}")
    assert code == 0 and "step 6: validation loss" in out and "perplexity" in out, out[-2000:]
    loss = float(out.split("validation loss ")[1].split(",")[0])
    code, out = cli("generate", f"run.dir={run}", "prompt=def ", "max_new_tokens=5")
    assert code == 0 and out.startswith("def "), out[-2000:]

    # init_from: the run's weights, a fresh optimizer, step 0: the first validation loss is the
    # run's own
    code, out = cli("train", "model.name=llama", *SMALL, *data, "train.steps=1",
                    f"init_from={run}", f"run.dir={tmp_path / 'fine'}")
    assert code == 0 and "fresh optimizer, step 0" in out, out[-3000:]
    assert f"step 0: validation loss {loss:.4f}" in out

    # a Hugging Face directory (weights + its tokenizer): generate and eval from it
    from fiddlejax.app import runs

    _, model, _ = runs.restore(run)
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    shutil.copy(tmp_path / "tokenizer.json", hf / "tokenizer.json")
    code, out = cli("generate", f"model.from_pretrained={hf}", "prompt=import ",
                    "max_new_tokens=4")
    assert code == 0 and out.startswith("import "), out[-2000:]
    from fiddlejax.app import inference

    assert inference.main("eval", ["batches=2"]) == 2  # neither run.dir nor from_pretrained


def gpt2_reference(t: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """GPT-2's forward (transformers' GPT2LMHeadModel, eval mode) in numpy, from the tensors
    of a Hugging Face gpt2 directory: an independent reading of the exported weights."""
    import math

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    n, d, h = ids.shape[1], cfg["n_embd"], cfg["n_head"]
    x = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][np.arange(n)]
    for i in range(cfg["n_layer"]):
        p = lambda k, i=i: t[f"transformer.h.{i}.{k}"]
        a = ln(x, p("ln_1.weight"), p("ln_1.bias")) @ p("attn.c_attn.weight") \
            + p("attn.c_attn.bias")
        q, k, v = (z.reshape(*z.shape[:2], h, d // h).transpose(0, 2, 1, 3)
                   for z in np.split(a, 3, axis=-1))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // h)
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        ctx = (w / w.sum(-1, keepdims=True)) @ v
        x = x + ctx.transpose(0, 2, 1, 3).reshape(*x.shape) @ p("attn.c_proj.weight") \
            + p("attn.c_proj.bias")
        m = gelu_new(ln(x, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight")
                     + p("mlp.c_fc.bias"))
        x = x + m @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = ln(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"])
    head = t["transformer.wte.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_exports_as_hugging_face_gpt2(tmp_path, tied):
    from flax import nnx

    from fiddlejax.models.gpt import GPT, GPTConfig
    from fiddlejax.models.gpt2_hf import save_gpt2
    from fiddlejax.models.hf import read_safetensors

    model = GPT(GPTConfig(vocab_size=61, seq_len=16, d_model=32, n_heads=4, n_layers=2,
                          d_ff=64, tie_embeddings=tied), rngs=nnx.Rngs(1))
    # non-zero biases and norms, so a misplaced one shows
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape), state))
    save_gpt2(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
    ids = rng.integers(0, 61, (2, 16))
    ref = gpt2_reference(read_safetensors(tmp_path), cfg, ids)
    assert rel_err(np.asarray(model(jnp.asarray(ids))), ref) < 1e-5
