"""Hugging Face checkpoints for :mod:`.decoder` (every family), without torch: config + safetensors.

Reading: :func:`read_config` and :func:`read_safetensors` (one ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``), then :func:`params_from_hf` maps the tensors onto a
model's canonical parameters. Writing: :func:`hf_tensors` maps them back, and
:func:`write_pretrained` writes ``config.json`` and the shards as transformers does. The layout
matches transformers' exactly, so each tensor converts by a transpose and a reshape (Phi-3's
fused projections by a split), never a permutation. A mixture of experts (Mixtral, Qwen3-MoE)
stores each expert's matrices as tensors of their own, as the Hub's checkpoints and
transformers' ``save_pretrained`` do; transformers' fused in-memory layout (``gate_up_proj``
``[E, 2f, d]``) reads too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def read_config(directory: str | Path) -> dict:
    """A Hugging Face model directory's ``config.json``, parsed."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; pass a Hugging Face model "
                                "directory (config.json + *.safetensors)")
    return json.loads(cfg_path.read_text())


def write_pretrained(directory: str | Path, tensors: dict[str, np.ndarray], config: dict,
                     max_shard_size: int | str, dtype: str) -> None:
    """Write ``config`` as ``config.json`` and ``tensors`` (float32) as safetensors shards of at
    most ``max_shard_size``, cast to ``dtype`` ("float32" or "bfloat16") first."""
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    elif dtype != "float32":
        raise ValueError(f"dtype={dtype!r} must be 'float32' or 'bfloat16'")
    config = {**config, "torch_dtype": dtype}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(directory, tensors, parse_size(max_shard_size))
    readable(directory.glob("*.safetensors"))


# -- weight conversion ---------------------------------------------------------------------------
# Per layer: (our name, Hugging Face name, to ours, to Hugging Face). torch Linear weights are
# [out, in]; ours are [in, ...out] with heads split out. The options of the config add biases,
# query/key norms and the norms after each sub-layer (Gemma 2/3).
def _layer_map(c: Any) -> list[tuple]:
    d, h, kv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ident = lambda w: w
    t = lambda w: w.T
    sandwich = getattr(c, "sandwich_norms", False)
    rows = [
        (("attn_norm", "weight"), "input_layernorm.weight", ident, ident),
        (("wq",), "self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, dh),
         lambda w: w.reshape(d, h * dh).T),
        (("wk",), "self_attn.k_proj.weight", lambda w: w.T.reshape(d, kv, dh),
         lambda w: w.reshape(d, kv * dh).T),
        (("wv",), "self_attn.v_proj.weight", lambda w: w.T.reshape(d, kv, dh),
         lambda w: w.reshape(d, kv * dh).T),
        (("wo",), "self_attn.o_proj.weight", lambda w: w.T.reshape(h, dh, d),
         lambda w: w.reshape(h * dh, d).T),
        (("mlp_norm", "weight"), ("pre_feedforward_layernorm.weight" if sandwich
                                  else "post_attention_layernorm.weight"), ident, ident),
    ]
    if getattr(c, "num_experts", 0):
        rows += _expert_map(c)
    else:
        rows += [(("w1",), "mlp.gate_proj.weight", t, t), (("w3",), "mlp.up_proj.weight", t, t),
                 (("w2",), "mlp.down_proj.weight", t, t)]
    if getattr(c, "attention_bias", False):
        rows += [(("bq",), "self_attn.q_proj.bias", lambda b: b.reshape(h, dh),
                  lambda b: b.reshape(h * dh)),
                 (("bk",), "self_attn.k_proj.bias", lambda b: b.reshape(kv, dh),
                  lambda b: b.reshape(kv * dh)),
                 (("bv",), "self_attn.v_proj.bias", lambda b: b.reshape(kv, dh),
                  lambda b: b.reshape(kv * dh))]
    if getattr(c, "qk_norm", False):
        rows += [(("q_norm", "weight"), "self_attn.q_norm.weight", ident, ident),
                 (("k_norm", "weight"), "self_attn.k_norm.weight", ident, ident)]
    if sandwich:
        rows += [(("attn_post_norm", "weight"), "post_attention_layernorm.weight", ident, ident),
                 (("mlp_post_norm", "weight"), "post_feedforward_layernorm.weight", ident,
                  ident)]
    return rows


# The experts' names per family: (the MoE block, gate, up, down). A name with ``{e}`` is one
# tensor per expert: they stack on our leading expert axis (torch's [out, in] swapped per expert).
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _expert_map(c: Any) -> list[tuple]:
    if c.model_type not in EXPERT_NAMES:
        raise ValueError(f"num_experts={c.num_experts} with model_type={c.model_type!r}: a "
                         "mixture of experts reads and writes Hugging Face checkpoints as "
                         f"one of {tuple(EXPERT_NAMES)}; set model_type to one of them")
    block, gate, up, down = EXPERT_NAMES[c.model_type]
    t = lambda w: np.swapaxes(w, -1, -2)
    return [(("moe", "router"), f"{block}.gate.weight", t, t),
            (("moe", "w_gate"), f"{block}.experts.{{e}}.{gate}.weight", t, t),
            (("moe", "w_up"), f"{block}.experts.{{e}}.{up}.weight", t, t),
            (("moe", "w_down"), f"{block}.experts.{{e}}.{down}.weight", t, t)]


def _unfuse_experts(tensors: dict[str, np.ndarray], c: Any) -> dict[str, np.ndarray]:
    """transformers' fused expert tensors (``mlp.experts.gate_up_proj [E, 2f, d]``,
    ``mlp.experts.down_proj [E, d, f]``, router ``mlp.gate``) as one tensor per expert."""
    out = dict(tensors)
    block, gate, up, down = EXPERT_NAMES[c.model_type]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        if pre + "mlp.experts.gate_up_proj" not in out:
            continue
        w, wd = out.pop(pre + "mlp.experts.gate_up_proj"), out.pop(pre + "mlp.experts.down_proj")
        f = w.shape[1] // 2
        for e in range(w.shape[0]):
            for name, v in ((gate, w[e, :f]), (up, w[e, f:]), (down, wd[e])):
                out[f"{pre}{block}.experts.{e}.{name}.weight"] = v
        if pre + "mlp.gate.weight" in out:
            out[f"{pre}{block}.gate.weight"] = out.pop(pre + "mlp.gate.weight")
    return out


def _get(state, path):
    for p in path:
        state = state[p]
    return state


# Phi-3 stores Q, K and V as one qkv_proj and gate and up as one gate_up_proj. They are split at
# load, so tensor parallelism shards each over its own heads or units (a fused matrix split in
# contiguous blocks would hand a device queries of one head and keys of another), and fused
# again at save.
def _split_fused(tensors: dict[str, np.ndarray], c: Any) -> dict[str, np.ndarray]:
    out = dict(tensors)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        if pre + "self_attn.qkv_proj.weight" in out:
            w = out.pop(pre + "self_attn.qkv_proj.weight")
            out[pre + "self_attn.q_proj.weight"] = w[:q]
            out[pre + "self_attn.k_proj.weight"] = w[q:q + kv]
            out[pre + "self_attn.v_proj.weight"] = w[q + kv:]
        if pre + "mlp.gate_up_proj.weight" in out:
            w = out.pop(pre + "mlp.gate_up_proj.weight")
            half = w.shape[0] // 2
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = w[:half], w[half:]
    return out


def _fuse(tensors: dict[str, np.ndarray], c: Any) -> dict[str, np.ndarray]:
    out = {}
    for k, v in tensors.items():
        if k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                       "mlp.up_proj.weight")):
            continue
        if k.endswith("self_attn.q_proj.weight"):
            pre = k[: -len("q_proj.weight")]
            out[pre + "qkv_proj.weight"] = np.concatenate(
                [v, tensors[pre + "k_proj.weight"], tensors[pre + "v_proj.weight"]])
        elif k.endswith("mlp.gate_proj.weight"):
            pre = k[: -len("gate_proj.weight")]
            out[pre + "gate_up_proj.weight"] = np.concatenate([v, tensors[pre + "up_proj.weight"]])
        else:
            out[k] = v
    return out


def hf_tensors(params: nnx.State, config: Any) -> dict[str, np.ndarray]:
    """Hugging Face tensor names -> float32 numpy arrays for canonical parameters ``params`` of
    a decoder with ``config`` (fused as the family stores them: Phi-3)."""
    arr = lambda path: np.asarray(_get(params, path)[...], dtype=np.float32)
    out = {"model.embed_tokens.weight": arr(("embed",))}
    stacked_ = {ours: arr(("blocks", *ours)) for ours, *_ in _layer_map(config)}
    for i in range(config.num_hidden_layers):
        for ours, hf, _, to_hf in _layer_map(config):
            w = to_hf(stacked_[ours][i])
            if "{e}" in hf:  # one tensor per expert
                out.update({f"model.layers.{i}.{hf.format(e=e)}": np.ascontiguousarray(x)
                            for e, x in enumerate(w)})
            else:
                out[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(w)
    out["model.norm.weight"] = arr(("norm", "weight"))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(arr(("lm_head",)).T)
    return _fuse(out, config) if getattr(config, "model_type", "") == "phi3" else out


def params_from_hf(tensors: dict[str, np.ndarray], config: Any, template: nnx.State,
                   what: str = "Llama", dtype: Any = None) -> nnx.State:
    """Canonical parameters (the tree of ``template``) from Hugging Face tensors, as float32
    (or ``dtype``). ``what``: the model's name, for the messages."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(config, "model_type", "") == "phi3":
        tensors = _split_fused(tensors, config)
    if getattr(config, "num_experts", 0):
        tensors = _unfuse_experts(tensors, config)
    used: set[str] = set()
    arch = what if what != "Llama" else "LlamaForCausalLM"

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks {name!r}; is it a {arch} "
                             f"checkpoint with num_hidden_layers={config.num_hidden_layers}?")
        used.add(name)
        return np.asarray(tensors[name], dtype=np.float32)

    values = {("embed",): take("model.embed_tokens.weight"),
              ("norm", "weight"): take("model.norm.weight")}
    def layer(i: int, hf: str) -> np.ndarray:  # one tensor, or one per expert stacked
        if "{e}" not in hf:
            return take(f"model.layers.{i}.{hf}")
        return np.stack([take(f"model.layers.{i}.{hf.format(e=e)}")
                         for e in range(config.num_experts)])

    for ours, hf, to_ours, _ in _layer_map(config):
        values[("blocks", *ours)] = np.stack(
            [to_ours(layer(i, hf)) for i in range(config.num_hidden_layers)])
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some writers store the tied copy; the embedding wins
    else:
        values[("lm_head",)] = take("lm_head.weight").T
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"the checkpoint has tensors this {what} does not use: {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''}; is config.json the right one?")

    def fill(path, v):
        key = tuple(str(getattr(k, "key", k)) for k in path)
        want = values[key]
        if tuple(want.shape) != tuple(v.shape):
            raise ValueError(f"{'.'.join(key)}: checkpoint shape {want.shape} does not match "
                             f"config.json's {tuple(v.shape)}")
        return v.replace(jnp.asarray(want, dtype or jnp.float32))

    return jax.tree_util.tree_map_with_path(fill, template,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


# -- safetensors files ---------------------------------------------------------------------------
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's ``model.safetensors`` or its sharded files (via the index)."""
    from safetensors import safe_open

    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise FileNotFoundError(f"{directory} has neither {SINGLE} nor {INDEX}; pytorch_model.bin "
                                "checkpoints need converting to safetensors first")
    out: dict[str, np.ndarray] = {}
    for name in files:
        with safe_open(str(directory / name), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                out[key] = f.get_tensor(key)
    return out


def write_safetensors(directory: Path, tensors: dict[str, np.ndarray], max_shard_size: int
                      ) -> None:
    """One ``model.safetensors``, or shards of at most ``max_shard_size`` bytes plus an index
    (a tensor larger than the limit gets a shard of its own), as transformers writes them."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, v in tensors.items():
        if shards[-1] and size + v.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    for old in [*directory.glob("model*.safetensors"), directory / INDEX]:
        old.unlink(missing_ok=True)  # a previous export's shards would mix in
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE), metadata=meta)
        return
    n, weight_map = len(shards), {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(directory / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9) or "2GiB" (2^30), as transformers."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r} must be a positive number of bytes or a "
                         "string like '500MB' or '2GiB'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
             "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def readable(paths) -> None:
    """Give files the mode a plain ``open`` would (0644 under umask 022): safetensors writes
    through a private temporary file (0600), config.json does not."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    for p in paths:
        os.chmod(p, 0o666 & ~mask)
