"""``fiddlejax export --adapter``: a PEFT adapter that peft loads onto the base and that gives our
logits there (recorded offline with torch, transformers and peft by
tests/fixtures/make_peft_fixture.py; no torch here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from fiddlejax.finetune import lora

FIX = Path(__file__).parent / "fixtures"
OUT = FIX / "peft_qwen3"


def maker():
    spec = importlib.util.spec_from_file_location("make_peft_fixture",
                                                  FIX / "make_peft_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peft_loaded_adapter_gives_our_logits():
    mk = maker()
    model = mk.adapted()
    tensors, config = mk.adapter_files(model)
    # what we export is the committed adapter peft loaded, name for name and value for value
    committed = load_file(str(OUT / "adapter_model.safetensors"))
    assert sorted(tensors) == sorted(committed) and len(tensors) == 2 * 7 * 2
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in tensors
    for k, v in tensors.items():
        np.testing.assert_allclose(v, committed[k], rtol=1e-6, atol=1e-7, err_msg=k)  # ulps
    assert config == json.loads((OUT / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"]) == ("LORA", "CAUSAL_LM", 4)
    want = json.loads((OUT / "expected.json").read_text())
    got = np.asarray(nnx.jit(lambda m, t: m(t))(model, np.asarray(want["tokens"], np.int32))[0])
    logits, base = np.asarray(want["logits"]), np.asarray(want["base_logits"])
    err = np.linalg.norm(got - logits) / np.linalg.norm(logits)
    print(f"ours vs peft's logits: rel {err:.1e}")
    assert err < 1e-5
    assert np.linalg.norm(base - logits) / np.linalg.norm(logits) > 1e-2  # the adapter matters


def test_only_lora_runs_export_an_adapter():
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.peft_adapter({("blocks", "wq"): (2, 4, 4)}, None, lora.LoRA(rank=4), None)
