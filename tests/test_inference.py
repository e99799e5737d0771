"""Generation with a KV cache equals generation without (greedy), for GPT and Llama; the cached
logits equal the full forward's; `fiddlejax eval`, `fiddlejax generate` and `init_from` work from
a run and from a Hugging Face directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

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
