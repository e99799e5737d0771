"""Hugging Face checkpoints for :mod:`.decoder` (every family), without torch: config + safetensors.

Reading: :func:`read_config`, then :func:`load_params` maps the tensors (their headers:
:func:`.hf_io.sources`) onto a model's canonical parameters, each leaf read by the slices its
devices hold. Writing: :func:`hf_plan` names and shapes each tensor of the canonical
parameters, and :func:`save_params` writes ``config.json`` and the files tensor by tensor, as
transformers lays them out (:func:`hf_tensors`, :func:`read_safetensors`: whole dictionaries,
for tests and small models). The layout matches transformers' exactly, so each tensor
converts by a transpose and a reshape (Phi-3's fused projections by a split; GPT-OSS's
interleaved experts by its config's ``hf_unfuse``/``hf_fuse``), never a permutation. A mixture
of experts (Mixtral, Qwen3-MoE) stores each expert's matrices as tensors of their own, as the
Hub's checkpoints and transformers' ``save_pretrained`` do; transformers' fused in-memory
layout (``gate_up_proj`` ``[E, 2f, d]``) reads too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from . import hf_io


def read_config(directory: str | Path) -> dict:
    """A Hugging Face model directory's ``config.json``, parsed."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; pass a Hugging Face model "
                                "directory (config.json + *.safetensors)")
    return json.loads(cfg_path.read_text())


def write_config(directory: str | Path, config: dict, dtype: str) -> None:
    """``config.json`` (``torch_dtype``: ``dtype``), the directory made if missing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": dtype}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_pretrained(directory: str | Path, tensors: dict[str, np.ndarray], config: dict,
                     max_shard_size: int | str, dtype: str) -> None:
    """Write ``config`` as ``config.json`` and ``tensors`` as safetensors shards of at most
    ``max_shard_size``, cast to ``dtype`` ("float32" or "bfloat16") one at a time."""
    np_dtype = hf_io.np_dtype(dtype)
    write_config(directory, config, dtype)
    hf_io.write(Path(directory), [(k, v.shape) for k, v in tensors.items()],
                tensors.items(), parse_size(max_shard_size), np_dtype)


# -- weight conversion ---------------------------------------------------------------------------
# Per layer: (our name, Hugging Face name, to ours, to Hugging Face). torch Linear weights are
# [out, in]; ours are [in, ...out] with heads split out. The options of the config add biases,
# query/key norms and the norms after each sub-layer (Gemma 2/3).
def _layer_map(c: Any) -> list[tuple]:
    """Rows (ours, theirs, transposed, to theirs): ours is theirs with the last two axes swapped
    (``transposed``) and reshaped to our shape (heads split out)."""
    d, h, kv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    ident, t = (lambda w: w), (lambda w: w.T)
    sandwich = getattr(c, "sandwich_norms", False)
    rows = [
        (("attn_norm", "weight"), "input_layernorm.weight", False, ident),
        (("wq",), "self_attn.q_proj.weight", True, lambda w: w.reshape(d, h * dh).T),
        (("wk",), "self_attn.k_proj.weight", True, lambda w: w.reshape(d, kv * dh).T),
        (("wv",), "self_attn.v_proj.weight", True, lambda w: w.reshape(d, kv * dh).T),
        (("wo",), "self_attn.o_proj.weight", True, lambda w: w.reshape(h * dh, d).T),
        (("mlp_norm", "weight"), ("pre_feedforward_layernorm.weight" if sandwich
                                  else "post_attention_layernorm.weight"), False, ident),
    ]
    if getattr(c, "num_experts", 0):
        rows += _expert_map(c)
    else:
        rows += [(("w1",), "mlp.gate_proj.weight", True, t),
                 (("w3",), "mlp.up_proj.weight", True, t),
                 (("w2",), "mlp.down_proj.weight", True, t)]
    if getattr(c, "attention_bias", False):
        rows += [(("bq",), "self_attn.q_proj.bias", False, lambda b: b.reshape(h * dh)),
                 (("bk",), "self_attn.k_proj.bias", False, lambda b: b.reshape(kv * dh)),
                 (("bv",), "self_attn.v_proj.bias", False, lambda b: b.reshape(kv * dh))]
    if getattr(c, "qk_norm", False):
        rows += [(("q_norm", "weight"), "self_attn.q_norm.weight", False, ident),
                 (("k_norm", "weight"), "self_attn.k_norm.weight", False, ident)]
    if sandwich:
        rows += [(("attn_post_norm", "weight"), "post_attention_layernorm.weight", False, ident),
                 (("mlp_post_norm", "weight"), "post_feedforward_layernorm.weight", False,
                  ident)]
    return rows


def _stacks(c: Any) -> list[tuple]:
    """(our stack, the checkpoint's layers it holds, a layer's rows) per stack of layers: the
    config's own ``hf_stacks()`` (DeepSeek-V3's dense and MoE layers), or ``blocks``."""
    own = getattr(c, "hf_stacks", None)
    return own() if own else [("blocks", range(c.num_hidden_layers), _layer_map(c))]


# The experts' names per family: (the MoE block, gate, up, down). A name with ``{e}`` is one
# tensor per expert: they stack on our leading expert axis (torch's [out, in] swapped per expert).
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                **dict.fromkeys(("qwen3_moe", "deepseek_v3"),
                                ("mlp", "gate_proj", "up_proj", "down_proj"))}


def _expert_map(c: Any) -> list[tuple]:
    if c.model_type not in EXPERT_NAMES:
        raise ValueError(f"num_experts={c.num_experts} with model_type={c.model_type!r}: a "
                         "mixture of experts reads and writes Hugging Face checkpoints as "
                         f"one of {tuple(EXPERT_NAMES)}; set model_type to one of them")
    block, gate, up, down = EXPERT_NAMES[c.model_type]
    t = lambda w: np.swapaxes(w, -1, -2)
    return [(("moe", "router"), f"{block}.gate.weight", True, t),
            (("moe", "w_gate"), f"{block}.experts.{{e}}.{gate}.weight", True, t),
            (("moe", "w_up"), f"{block}.experts.{{e}}.{up}.weight", True, t),
            (("moe", "w_down"), f"{block}.experts.{{e}}.{down}.weight", True, t)]


def _unfuse_experts(tensors: dict, c: Any) -> dict:
    """transformers' fused expert tensors (``mlp.experts.gate_up_proj [E, 2f, d]``,
    ``mlp.experts.down_proj [E, d, f]``, router ``mlp.gate``) as one tensor per expert."""
    out = dict(tensors)
    block, gate, up, down = EXPERT_NAMES[c.model_type]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        if pre + "mlp.experts.gate_up_proj" not in out:
            continue
        w, wd = out.pop(pre + "mlp.experts.gate_up_proj"), out.pop(pre + "mlp.experts.down_proj")
        e_, f2, d = w.shape
        f = f2 // 2
        for e in range(e_):
            for name, v in ((gate, hf_io.Part(w, (e,), 0, (f, d))),
                            (up, hf_io.Part(w, (e,), f, (f, d))),
                            (down, hf_io.Part(wd, (e,), 0, wd.shape[1:]))):
                out[f"{pre}{block}.experts.{e}.{name}.weight"] = v
        if pre + "mlp.gate.weight" in out:
            out[f"{pre}{block}.gate.weight"] = out.pop(pre + "mlp.gate.weight")
    return out


def _key(path) -> tuple[str, ...]:
    return tuple(str(k.key) for k in path if hasattr(k, "key"))


# Phi-3 stores Q, K and V as one qkv_proj and gate and up as one gate_up_proj. They are split at
# load, so tensor parallelism shards each over its own heads or units (a fused matrix split in
# contiguous blocks would hand a device queries of one head and keys of another), and fused
# again at save.
def _split_fused(tensors: dict, c: Any) -> dict:
    out = dict(tensors)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        if pre + "self_attn.qkv_proj.weight" in out:
            w = out.pop(pre + "self_attn.qkv_proj.weight")
            rows = w.shape[1:]
            for name, start, n in (("q", 0, q), ("k", q, kv), ("v", q + kv, w.shape[0] - q - kv)):
                out[f"{pre}self_attn.{name}_proj.weight"] = hf_io.Part(w, (), start, (n, *rows))
        if pre + "mlp.gate_up_proj.weight" in out:
            w = out.pop(pre + "mlp.gate_up_proj.weight")
            half = w.shape[0] // 2
            out[pre + "mlp.gate_proj.weight"] = hf_io.Part(w, (), 0, (half, *w.shape[1:]))
            out[pre + "mlp.up_proj.weight"] = hf_io.Part(w, (), half,
                                                         (w.shape[0] - half, *w.shape[1:]))
    return out


# -- theirs from ours: planned, then produced one tensor at a time ----------------------------
Need = tuple[tuple[str, ...], int | None]  # (our leaf, layer or None)


def hf_plan(config: Any, shapes: dict[tuple[str, ...], tuple[int, ...]]
            ) -> list[tuple[str, tuple[int, ...], list[Need], Any]]:
    """Each Hugging Face tensor of canonical parameters with ``shapes`` (our leaf -> shape):
    (name, shape, the layers of our leaves it needs, a function of them giving it), grouped
    by our leaf (fused as the family stores them: Phi-3)."""
    def abstract(key, i=None):  # no data
        return np.broadcast_to(np.empty((), np.int8), shapes[key][1 if i is not None else 0:])

    plan = [("model.embed_tokens.weight", shapes[("embed",)], [(("embed",), None)],
             lambda xs: xs[0])]
    for stack, layers, layer_map in _stacks(config):
        for ours, hf, _, to_hf in layer_map:
            key, one = (stack, *ours), abstract((stack, *ours), 0)
            for j, i in enumerate(layers):  # j: the layer in our stack, i: in the checkpoint
                if "{e}" in hf:  # one tensor per expert
                    plan += [(f"model.layers.{i}.{hf.format(e=e)}", to_hf(one[e]).shape,
                              [(key, j)], lambda xs, e=e, f=to_hf: f(xs[0][e]))
                             for e in range(shapes[key][1])]
                else:
                    plan.append((f"model.layers.{i}.{hf}", to_hf(one).shape, [(key, j)],
                                 lambda xs, f=to_hf: f(xs[0])))
    plan.append(("model.norm.weight", shapes[("norm", "weight")], [(("norm", "weight"), None)],
                 lambda xs: xs[0]))
    copies = getattr(config, "hf_copies", list)()  # DeepSeek-V3's MTP layers
    for name, key, tr in ([] if config.tie_word_embeddings else [("lm_head.weight",
                          ("lm_head",), True)]) + copies:
        s = shapes[key][::-1] if tr else shapes[key]
        plan.append((name, s, [(key, None)], (lambda xs: xs[0].T) if tr else (lambda xs: xs[0])))
    own = getattr(config, "hf_fuse", None)  # a family's own fused tensors (GPT-OSS)
    return own(plan) if own else _fuse(plan) if config.model_type == "phi3" else plan


def _fuse(plan: list) -> list:
    """Phi-3's q/k/v and gate/up rows as its fused qkv_proj and gate_up_proj."""
    by_name = {p[0]: p for p in plan}
    out = []
    for name, shape, needs, make in plan:
        parts = None
        if name.endswith("self_attn.q_proj.weight"):
            pre, parts = name[: -len("q_proj.weight")], ("q", "k", "v")
            fused = pre + "qkv_proj.weight"
        elif name.endswith("mlp.gate_proj.weight"):
            pre, parts = name[: -len("gate_proj.weight")], ("gate", "up")
            fused = pre + "gate_up_proj.weight"
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "mlp.up_proj.weight")):
            continue
        if parts is None:
            out.append((name, shape, needs, make))
            continue
        rows = [by_name[f"{pre}{p}_proj.weight"] for p in parts]
        makes = [r[3] for r in rows]
        out.append((fused, (sum(r[1][0] for r in rows), *shape[1:]),
                    [n for r in rows for n in r[2]],
                    lambda xs, makes=makes: np.concatenate([m([x]) for m, x in zip(makes, xs)])))
    return out


def hf_tensors(params: nnx.State, config: Any) -> dict[str, np.ndarray]:
    """Hugging Face tensor names -> float32 numpy arrays for canonical parameters ``params`` of
    a decoder with ``config`` (fused as the family stores them: Phi-3)."""
    flat = flat_params(params)
    plan = hf_plan(config, {k: tuple(v.shape) for k, v in flat.items()})
    return {name: np.ascontiguousarray(np.asarray(a, np.float32))
            for name, a in hf_io.stream(plan, flat.__getitem__)}


def save_params(directory: str | Path, leaf: Any, shapes: dict, config: Any, hf_config: dict,
                max_shard_size: int | str, dtype: str) -> None:
    """Write a decoder's parameters as a Hugging Face directory, tensor by tensor: ``leaf(key)``
    gives our leaf (a sharded ``jax.Array`` is gathered one layer at a time). Process 0
    writes; the others take part in the gathers."""
    writer = jax.process_index() == 0
    if writer:
        write_config(directory, hf_config, dtype)
    plan = hf_plan(config, shapes)
    hf_io.write(Path(directory), [(n, s) for n, s, _, _ in plan], hf_io.stream(plan, leaf),
                parse_size(max_shard_size), hf_io.np_dtype(dtype), writer)


def flat_params(params: nnx.State) -> dict[tuple[str, ...], Any]:
    """Our leaves by key (``("blocks", "wq")``)."""
    return {_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _rows(tensors: dict, config: Any, what: str) -> dict:
    """Our leaf key -> (its source(s): one, one per layer, or per layer per expert;
    transposed; stacked), every tensor of ``tensors`` (name -> :mod:`.hf_io` source) used."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(config, "model_type", "") == "phi3":
        tensors = _split_fused(tensors, config)
    if getattr(config, "num_experts", 0):  # per-expert tensors (GPT-OSS: its own hf_unfuse)
        tensors = getattr(config, "hf_unfuse", lambda t: _unfuse_experts(t, config))(tensors)
    used: set[str] = set()
    arch = what if what != "Llama" else "LlamaForCausalLM"

    def take(name: str):
        if name not in tensors:
            raise ValueError(f"the checkpoint lacks {name!r}; is it a {arch} "
                             f"checkpoint with num_hidden_layers={config.num_hidden_layers}?")
        used.add(name)
        return tensors[name]

    def layer(i: int, hf: str):  # one tensor, or one per expert
        if "{e}" not in hf:
            return take(f"model.layers.{i}.{hf}")
        return [take(f"model.layers.{i}.{hf.format(e=e)}") for e in range(config.num_experts)]

    rows = {("embed",): (take("model.embed_tokens.weight"), False, False),
            ("norm", "weight"): (take("model.norm.weight"), False, False)}
    for stack, layers, layer_map in _stacks(config):
        for ours, hf, tr, _ in layer_map:
            rows[(stack, *ours)] = ([layer(i, hf) for i in layers], tr, True)
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some writers store the tied copy; the embedding wins
    else:
        rows[("lm_head",)] = (take("lm_head.weight"), True, False)
    used.update(name for name, _, _ in getattr(config, "hf_copies", list)())  # checked apart
    unused = getattr(config, "hf_unused", lambda name: False)
    extra = sorted(k for k in set(tensors) - used if not unused(k))
    if extra:
        raise ValueError(f"the checkpoint has tensors this {what} does not use: {extra[:5]}"
                         f"{' ...' if len(extra) > 5 else ''}; is config.json the right one?")
    return rows


def check_shapes(tensors: dict, config: Any, template: nnx.State, what: str = "Llama") -> None:
    """Every tensor (each layer's, each expert's) against the shape ``config`` gives it, from
    the headers (no data read): a mismatch names the tensor, its file and config.json's
    sizes, before anything is built."""
    rows = _rows(tensors, config, what)
    for path, v in jax.tree_util.tree_flatten_with_path(
            template, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        src, tr, stacked = rows[_key(path)]
        experts = stacked and isinstance(src[0], list)
        shape = tuple(v.shape)
        inner = shape[(1 + experts) if stacked else 0:]
        each = [x for layer in src for x in (layer if experts else [layer])] if stacked else [src]
        for i, one in enumerate(src if experts else []):
            if len(one) != shape[1]:
                raise ValueError(f"layer {i} has {len(one)} experts; config.json has "
                                 f"num_experts={shape[1]}")
        for one in each:
            if not hf_io.matches(one, tr, inner):
                dims = ", ".join(f"{k}={getattr(config, k)}" for k in (
                    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size") if getattr(config, k, None) is not None)
                raise ValueError(f"{hf_io.where(one)} has shape {tuple(one.shape)}, which does "
                                 f"not fit config.json ({dims}: {'.'.join(_key(path))} is "
                                 f"{inner}); is config.json the checkpoint's own?")


def load_params(tensors: dict, config: Any, template: nnx.State, what: str = "Llama",
                dtype: Any = None, shardings: Any = None) -> nnx.State:
    """Canonical parameters (the tree of ``template``) from Hugging Face tensors (a name ->
    :mod:`.hf_io` source or array), in the template's dtypes (or ``dtype``), each leaf placed by
    ``shardings`` (a function of our leaf's key, or None: the default device) and read by
    the slices this process's devices hold. ``what``: the model's name, for the messages."""
    if shardings is not None and not callable(shardings):  # a tree like the parameters'
        flat = {_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(
            shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}
        shardings = flat.__getitem__
    tensors = {k: v if hasattr(v, "read") else hf_io.InMemory(v) for k, v in tensors.items()}
    check_shapes(tensors, config, template, what)
    rows = _rows(tensors, config, what)

    def fill(path, v):
        key = _key(path)
        src, tr, stacked = rows[key]
        experts = stacked and isinstance(src[0], list)
        shape = tuple(v.shape)
        reader = hf_io.leaf_reader(src, tr, shape, stacked, experts)
        sharding = shardings(key) if shardings is not None else None
        return v.replace(hf_io.leaf_array(shape, sharding, reader, dtype or v.get_value().dtype))

    return jax.tree_util.tree_map_with_path(fill, template,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def params_from_hf(tensors: dict[str, np.ndarray], config: Any, template: nnx.State,
                   what: str = "Llama", dtype: Any = None) -> nnx.State:
    """Canonical parameters (the tree of ``template``) from in-memory Hugging Face tensors,
    as float32 (or ``dtype``), on the default device."""
    return load_params(tensors, config, template, what, dtype)


# -- safetensors files ---------------------------------------------------------------------------
INDEX, SINGLE = hf_io.INDEX, hf_io.SINGLE


def read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's ``model.safetensors`` or its sharded files (via the index),
    read whole (tests and small checkpoints; loading reads by slices, :func:`load_params`)."""
    full = lambda s: tuple(slice(0, n) for n in s.shape)
    return {k: s.read(full(s)) for k, s in hf_io.sources(Path(directory)).items()}


def write_safetensors(directory: Path, tensors: dict[str, np.ndarray], max_shard_size: int
                      ) -> None:
    """One ``model.safetensors``, or shards of at most ``max_shard_size`` bytes plus an index
    (a tensor larger than the limit gets a shard of its own), as transformers writes them."""
    dtypes = {np.asarray(v).dtype for v in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else np.float32
    hf_io.write(Path(directory), [(k, np.shape(v)) for k, v in tensors.items()],
                tensors.items(), max_shard_size, dtype)


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

