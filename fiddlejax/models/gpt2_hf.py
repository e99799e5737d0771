"""GPT as a Hugging Face ``gpt2`` directory (``GPT2LMHeadModel``): ``config.json`` and
safetensors, written without torch.

The bundled GPT is GPT-2's architecture: learned positions, pre-LayerNorm blocks (eps 1e-5),
the tanh GELU (``gelu_new``), the residual projections' biases. GPT-2's attention has a bias
on its fused Q/K/V projection that ours lacks, so ``c_attn.bias`` is written as zeros; its
``Conv1D`` weights are ``[in, out]``, ours with heads split out, so each weight is a reshape
(Q, K, V concatenated on the output axis), never a permutation. An untied head is written as
``lm_head.weight`` with ``tie_word_embeddings: false``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from . import hf


def gpt2_config(c) -> dict:
    """The ``config.json`` of a :class:`~models.gpt.GPTConfig`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": c.vocab_size, "n_positions": c.seq_len, "n_ctx": c.seq_len,
            "n_embd": c.d_model, "n_layer": c.n_layers, "n_head": c.n_heads,
            "n_inner": c.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "tie_word_embeddings": bool(c.tie_embeddings),
            "torch_dtype": "float32", "use_cache": True}


def gpt2_tensors(params: nnx.State, c) -> dict[str, np.ndarray]:
    """Hugging Face ``gpt2`` tensor names -> float32 arrays of GPT's canonical ``params``."""
    def get(*path):
        x = params
        for p in path:
            x = x[p]
        return np.asarray(x[...], np.float32)

    d = c.d_model
    out = {"transformer.wte.weight": get("wte"), "transformer.wpe.weight": get("wpe"),
           "transformer.ln_f.weight": get("ln_f", "scale"),
           "transformer.ln_f.bias": get("ln_f", "bias")}
    blocks = params["blocks"]
    for i in range(c.n_layers):
        def b(*path, _i=i):
            x = blocks
            for p in path:
                x = x[p]
            return np.asarray(x[...], np.float32)[_i]

        pre = f"transformer.h.{i}."
        qkv = [b(w).reshape(d, d) for w in ("wq", "wk", "wv")]
        out.update({
            pre + "ln_1.weight": b("ln1", "scale"), pre + "ln_1.bias": b("ln1", "bias"),
            pre + "attn.c_attn.weight": np.concatenate(qkv, axis=1),
            pre + "attn.c_attn.bias": np.zeros(3 * d, np.float32),
            pre + "attn.c_proj.weight": b("wo").reshape(d, d), pre + "attn.c_proj.bias": b("bo"),
            pre + "ln_2.weight": b("ln2", "scale"), pre + "ln_2.bias": b("ln2", "bias"),
            pre + "mlp.c_fc.weight": b("w1"), pre + "mlp.c_fc.bias": b("b1"),
            pre + "mlp.c_proj.weight": b("w2"), pre + "mlp.c_proj.bias": b("b2")})
    if not c.tie_embeddings:
        out["lm_head.weight"] = get("lm_head").T.copy()
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_gpt2(model, directory: str | Path, *, max_shard_size: int | str = "5GB",
              dtype: str = "float32") -> None:
    """Write ``model`` (a :class:`~models.gpt.GPT`) as a Hugging Face ``gpt2`` directory."""
    if getattr(model.config, "dropout", 0.0):
        raise ValueError("a GPT with dropout > 0 has no exact gpt2 twin; export its weights "
                         "with dropout=0")
    tensors = gpt2_tensors(nnx.state(model, nnx.Param), model.config)
    hf.write_pretrained(directory, tensors, gpt2_config(model.config), max_shard_size, dtype)
