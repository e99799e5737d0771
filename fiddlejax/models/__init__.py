"""Example models, and what the ``fiddlejax train`` job needs to know about each (:data:`REGISTRY`).

The library never imports this package; the job (``fiddlejax.app``) looks a model up by its
config name and asks the entry to build it, feed it, count its FLOPs and name its Muon matrices,
so the job holds no per-model code. Importing this package is cheap: each entry imports its
model module only when called.

The model names the job accepts (:mod:`.model_names`) are read from here too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from .feed import Batches, own_batches, own_data, token_batches, vocab_fix  # noqa: F401
from .model_names import DECODERS, MOES, NAMES, OVERRIDES  # noqa: F401
from .model_names import FAMILIES as HF_FAMILIES  # noqa: F401
from .model_names import resolve as resolve_name  # noqa: F401

# Muon orthogonalizes each layer's matrices: which axes of a stacked block leaf are the matrix's
# input (reduction) and output axes, counted from the end so every parallel layout agrees.
TRANSFORMER_MUON_AXES = {"w1": ((-2,), (-1,)), "w2": ((-2,), (-1,)), "wq": ((-3,), (-2, -1)),
                         "wk": ((-3,), (-2, -1)), "wv": ((-3,), (-2, -1)),
                         "wo": ((-3, -2), (-1,))}
LLAMA_MUON_AXES = {**TRANSFORMER_MUON_AXES, "w3": ((-2,), (-1,))}  # SwiGLU's up projection
# A mixture's experts ([layers, E, d, f]): each expert's matrix on its own (E is a batch axis);
# the router stays AdamW, like the other small non-square leaves Muon's authors leave out.
MOE_MUON_AXES = {**{k: v for k, v in TRANSFORMER_MUON_AXES.items() if k not in ("w1", "w2")},
                 **{f"moe.{k}": ((-2,), (-1,)) for k in ("w_gate", "w_up", "w_down")}}
# DeepSeek-V3's MoE layers: latent attention's low-rank matrices, the experts and the shared
# experts (its dense first layers stack apart, ``dense``, and stay AdamW, as does the full-rank
# query ``wq`` of a checkpoint without q_lora_rank: no DeepSeek-V3 or Kimi K2 has one).
MLA_MUON_AXES = {"attn.wq_a": ((-2,), (-1,)), "attn.wkv_a": ((-2,), (-1,)),
                 **{f"attn.{k}": ((-3,), (-2, -1)) for k in ("wq_b", "wkv_b")},
                 "attn.wo": ((-3, -2), (-1,)),
                 **{f"moe.{k}": ((-2,), (-1,)) for k in ("w_gate", "w_up", "w_down", "w1",
                                                         "w3", "w2")}}
CNN_MUON_AXES = {"k1": ((-4, -3, -2), (-1,)), "k2": ((-4, -3, -2), (-1,))}


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model as the ``fiddlejax train`` job sees it.

    - ``build(mcfg, seed)``: the model from the config's ``model:`` section.
    - ``batches(cfg, model, process_index, process_count)``: its :class:`Batches`.
    - ``flops_per_step(model, batch_size)``: analytic training FLOPs of one step (forward +
      backward, no remat) of the whole global batch, for TFLOP/s and MFU.
    - ``muon_axes``: stacked block leaf name (dotted below ``blocks``: ``"wq"``,
      ``"moe.w_gate"``) -> (reduction axes, output axes) for Muon.
    - ``correct(model, batch)``: ``(examples classified right, examples)`` of a validation
      batch, traced under ``jax.jit``; a classifier gives it and the job reports validation
      accuracy (None: loss only).
    """

    name: str
    build: Callable[[dict, int], Any]
    batches: Callable[[dict, Any, int, int], Batches]
    flops_per_step: Callable[[Any, int], float]
    muon_axes: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    correct: Callable[[Any, dict], tuple[Any, Any]] | None = None

    def muon_dims(self, params):
        """Muon's dimension numbers for the block matrices; None (AdamW) for the rest:
        embeddings, heads, norms and biases, as Muon's authors recommend. Pass it as optax's
        ``muon_weight_dimension_numbers``."""
        import jax
        from optax.contrib import MuonDimensionNumbers

        def dims(path, _):
            keys = [getattr(k, "key", None) for k in path]
            axes = (self.muon_axes.get(".".join(str(k) for k in keys[1:] if k is not None))
                    if len(keys) > 1 and keys[0] == "blocks" else None)
            return MuonDimensionNumbers(*axes) if axes else None

        return jax.tree_util.tree_map_with_path(dims, params)

    def uniform_loss(self, model) -> float:
        """The loss of a uniform guess over the model's outputs (classes or vocabulary)."""
        c = getattr(model, "config", None)
        n = getattr(c, "num_classes", None) or getattr(c, "vocab_size", None)
        return math.log(n) if n else math.nan


# -- shared pieces ----------------------------------------------------------------------------
def _pick(mcfg: dict, cls) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in mcfg.items() if k in names}


def vocab(mcfg: dict) -> int:
    """``model.vocab_size``; ``auto`` unresolved (the job resolves it from ``data.tokenizer``
    first) is the default tokenizer's size: bytes, or ``from_pretrained``'s own."""
    if mcfg.get("vocab_size", "auto") != "auto":
        return mcfg["vocab_size"]
    from fiddlejax.data import tokenizer

    return tokenizer.load("auto", mcfg.get("from_pretrained")).vocab_size


def transformer_flops(model, batch_size: int, lookups: tuple[str, ...] = ("wte", "wpe"),
                      tied: str | None = None) -> float:
    """6 N per token for the N matmul parameters plus 12 L T d for attention scores.

    ``lookups`` are embedding tables (gathers, not matmuls); ``tied``: the table that is also
    the head's matmul."""
    import jax
    from flax import nnx

    c = model.config
    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    n -= sum(params[k][...].size for k in lookups if k != tied)
    tokens = batch_size * c.seq_len
    return 6.0 * n * tokens + 12.0 * c.n_layers * c.seq_len * c.d_model * tokens


# -- the models -----------------------------------------------------------------------------------
def _gpt_build(mcfg: dict, seed: int):
    from flax import nnx

    from .gpt import GPT, GPTConfig

    return GPT(GPTConfig(**{**_pick(mcfg, GPTConfig), "vocab_size": vocab(mcfg)}),
               rngs=nnx.Rngs(seed))


def _gpt_batches(cfg, model, process_index, process_count) -> Batches:
    seq, vocab = cfg["model"]["seq_len"], model.config.vocab_size
    if own_data(cfg):
        train, val = own_batches(cfg, seq, vocab, process_index, process_count)
    else:
        train, val = token_batches(cfg, seq, vocab, process_index, process_count)
    return Batches(train, val, cfg["data"]["batch_size"] * seq)


def _gpt_flops(model, batch_size: int) -> float:
    return transformer_flops(model, batch_size,
                             tied="wte" if model.config.tie_embeddings else None)


def family_class(name: str):
    """The model class of a Hugging Face family (``config.json``'s ``model_type``)."""
    from .decoder import FAMILIES
    from .deepseek import DeepseekV3
    from .gpt_oss import GptOss
    from .llama import Llama

    classes = {"llama": Llama, **FAMILIES, DeepseekV3.model_type: DeepseekV3,
               GptOss.model_type: GptOss}
    if name not in classes or name not in HF_FAMILIES:
        raise ValueError(f"model_type={name!r}, which fiddlejax does not implement; supported: "
                         f"{', '.join(HF_FAMILIES)}")
    return classes[name]


def _llama_build(mcfg: dict, seed: int):
    from flax import nnx

    from .llama import Llama, LlamaConfig

    cls = family_class(mcfg["name"])  # model.name: the family (auto resolved to it)
    if mcfg.get("from_pretrained"):  # a Hugging Face directory: its config.json sets the dims
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        return cls.from_pretrained(mcfg["from_pretrained"], seq_len=mcfg["seq_len"],
                                   abstract=True,  # the caller loads: shards, or restores
                                   overrides={k: mcfg[k] for k in OVERRIDES
                                              if k in fields and k in mcfg})
    if mcfg["name"] != "llama":  # another family from scratch: its config.json defaults
        hf = {"model_type": mcfg["name"], "vocab_size": vocab(mcfg),
              "hidden_size": mcfg["d_model"], "intermediate_size": mcfg["d_ff"],
              "num_hidden_layers": mcfg["n_layers"], "num_attention_heads": mcfg["n_heads"],
              "num_key_value_heads": mcfg["n_kv_heads"], "rope_theta": mcfg["rope_theta"],
              "head_dim": mcfg["d_model"] // mcfg["n_heads"],
              "tie_word_embeddings": mcfg["tie_embeddings"],
              "max_position_embeddings": mcfg["seq_len"]}
        if mcfg["name"] == "qwen3_moe":  # Mixtral's 8 experts, top 2, model.d_ff wide
            hf.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=mcfg["d_ff"])
        if mcfg["name"] == "gpt_oss":  # 8 experts, top 2 (transformers': 128, top 4)
            hf.update(num_local_experts=8, num_experts_per_tok=2)
        if mcfg["name"] == "deepseek_v3":
            hf.update(_deepseek_dims(mcfg))
        config = cls.config_from_hf(hf, mcfg["seq_len"])
        fields = {f.name for f in dataclasses.fields(config)}
        config = dataclasses.replace(config, **{k: mcfg[k] for k in OVERRIDES
                                                if k in fields and k in mcfg})
        return cls(config, rngs=nnx.Rngs(seed))
    return Llama(LlamaConfig(
        vocab_size=vocab(mcfg), hidden_size=mcfg["d_model"],
        intermediate_size=mcfg["d_ff"], num_hidden_layers=mcfg["n_layers"],
        num_attention_heads=mcfg["n_heads"], num_key_value_heads=mcfg["n_kv_heads"],
        rope_theta=float(mcfg["rope_theta"]), tie_word_embeddings=mcfg["tie_embeddings"],
        max_position_embeddings=mcfg["seq_len"], seq_len=mcfg["seq_len"]), rngs=nnx.Rngs(seed))


def _deepseek_dims(mcfg: dict) -> dict:
    """A DeepSeek-V3 from scratch: heads ``d_model / n_heads`` wide (the rotary part half of
    it; keys and values per head, so ``n_kv_heads`` is ``n_heads``), latent ranks ``d_model / 2``,
    8 routed experts (top 2, one group) and a shared one ``d_ff`` wide, the first layer dense
    when there are several."""
    d, h = mcfg["d_model"], mcfg["d_model"] // mcfg["n_heads"]
    return dict(num_key_value_heads=mcfg["n_heads"], head_dim=h // 2, qk_rope_head_dim=h // 2,
                qk_nope_head_dim=h, v_head_dim=h, q_lora_rank=d // 2, kv_lora_rank=d // 2,
                n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                n_shared_experts=1, moe_intermediate_size=mcfg["d_ff"],
                routed_scaling_factor=1.0, first_k_dense_replace=min(1, mcfg["n_layers"] - 1))


def _llama_flops(model, batch_size: int) -> float:
    """Dims from the model: ``model.from_pretrained`` overrides the config's."""
    import jax
    from flax import nnx

    c = model.config
    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    if not c.tie_word_embeddings:
        n -= jax.tree.leaves(params["embed"])[0].size  # a lookup; tied, the head's matmul too
    if c.num_experts:  # a token runs num_experts_per_tok of the experts
        moe = params["blocks"]["moe"]
        experts = sum(jax.tree.leaves(moe[k])[0].size for k in ("w_gate", "w_up", "w_down"))
        n -= experts * (1 - c.num_experts_per_tok / c.num_experts)
    tokens = batch_size * c.seq_len  # scores: q.k (qk width) and p.v (v width), 6 per pair
    qk, v = getattr(c, "qk_head_dim", c.head_dim), getattr(c, "v_head_dim", c.head_dim)
    attn = 6.0 * c.num_hidden_layers * c.seq_len * c.num_attention_heads * (qk + v)
    return 6.0 * n * tokens + attn * tokens


def _bert_build(mcfg: dict, seed: int):
    from flax import nnx

    from .bert import BERT, BERTConfig

    fields = _pick(mcfg, BERTConfig)
    fields["vocab_size"] = vocab(mcfg) + 1  # + [MASK]
    return BERT(BERTConfig(**fields), rngs=nnx.Rngs(seed))


def _bert_batches(cfg, model, process_index, process_count) -> Batches:
    from .bert import masked_batches

    return masked_batches(cfg, model, process_index, process_count)


def _cnn_build(mcfg: dict, seed: int):
    from flax import nnx

    from .cnn import CNN, CNNConfig

    return CNN(CNNConfig(channels=mcfg["channels"], n_layers=mcfg["n_layers"]),
               rngs=nnx.Rngs(seed))


def _cnn_batches(cfg, model, process_index, process_count) -> Batches:
    from .cnn import digit_batches

    return digit_batches(cfg, process_index, process_count)


def _cnn_flops(model, batch_size: int) -> float:
    from .cnn import flops_per_step

    return flops_per_step(model.config, batch_size)


def _cnn_correct(model, batch: dict):
    from .cnn import correct

    return correct(model, batch)


REGISTRY: dict[str, ModelEntry] = {
    "gpt": ModelEntry("gpt", _gpt_build, _gpt_batches, _gpt_flops, TRANSFORMER_MUON_AXES),
    "bert": ModelEntry("bert", _bert_build, _bert_batches, transformer_flops,
                       TRANSFORMER_MUON_AXES),
    "cnn": ModelEntry("cnn", _cnn_build, _cnn_batches, _cnn_flops, CNN_MUON_AXES,
                      correct=_cnn_correct),
    "llama": ModelEntry("llama", _llama_build, _gpt_batches, _llama_flops, LLAMA_MUON_AXES),
}
# The other Hugging Face families: the same decoder, job and data (models/decoder.py).
for _family in HF_FAMILIES[1:]:
    REGISTRY[_family] = ModelEntry(_family, _llama_build, _gpt_batches, _llama_flops,
                                   MLA_MUON_AXES if _family == "deepseek_v3" else
                                   MOE_MUON_AXES if _family in MOES else LLAMA_MUON_AXES)


def get(name: str) -> ModelEntry:
    """The registry entry for ``model.name``; an error naming the known models otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"model.name={name!r} must be one of {', '.join(REGISTRY)}; add a "
                         "models.ModelEntry to models.REGISTRY for a new model")
    return REGISTRY[name]


def register(entry: ModelEntry) -> ModelEntry:
    """Add (or replace) a model the job can train by ``model.name``."""
    REGISTRY[entry.name] = entry
    return entry


# -- what eval, generate and export ask of a bundled model ---------------------------------------
def forward_loss(model, batch: dict):
    """The model's loss on ``batch``, unparallelized (prologue, stacked layers, head, loss):
    a scalar mean or a ``(sum, weight)`` pair, as the model's ``loss`` returns it."""
    from .common import scan_layers

    x = scan_layers(getattr(model, model.stack), model.prologue(batch))
    return model.loss(model.head(x), batch)


def generate_text(model, prompt, max_new_tokens: int, **kw):
    """A decoder's continuation of ``prompt`` with a KV cache (:mod:`.generate`)."""
    from .generate import generate as run

    return run(model, prompt, max_new_tokens, **kw)


def with_param_dtype(model, dtype: Any):
    """``model`` with every floating parameter in ``dtype`` (``model.param_dtype``; None or
    float32: as it is). Abstract parameters (``from_pretrained(..., abstract=True)``) change
    dtype too, so ``model.pretrained_params`` then reads the checkpoint straight into it: a
    bf16 checkpoint trains as bf16 parameters with no float32 copy (docs/precision.md)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if dtype is None or jnp.dtype(dtype) == jnp.float32:
        return model

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    nnx.update(model, jax.tree.map(cast, nnx.state(model, nnx.Param)))
    return model


def from_pretrained(path, *, seq_len: int | None = None, dtype=None, abstract: bool = False,
                    shardings=None, overrides: dict | None = None):
    """The model of a Hugging Face directory, whatever its family (``config.json``'s
    ``model_type``: llama, mistral, qwen2, qwen3, phi3, gemma, gemma2, gemma3_text, mixtral,
    qwen3_moe, deepseek_v3, gpt_oss): a :class:`~.llama.Llama` or another
    :class:`~.decoder.Decoder`.
    Weights load as float32 masters (or ``dtype``); ``seq_len``: the default batch length
    (any length up to ``max_position_embeddings`` is accepted). ``path`` may be a hub id in
    the local cache (``meta-llama/Llama-3.1-8B``; nothing downloads). Tensors are read by the
    slices each device holds (``shardings``), or not at all with ``abstract=True`` (then
    ``trainer.init(model.pretrained_params)``); ``overrides``: config fields the checkpoint
    does not hold (``{"bias_update_speed": 0.0}``). ``model.save_pretrained(dir)`` writes it
    back."""
    from fiddlejax.models import hub

    from .hf import read_config

    path = hub.local_dir(path)
    family = read_config(path).get("model_type", "llama")
    try:
        cls = family_class(family)
    except ValueError as e:
        raise ValueError(f"{path}/config.json has {e}") from None
    return cls.from_pretrained(path, seq_len=seq_len, dtype=dtype, abstract=abstract,
                               shardings=shardings, overrides=overrides)


def save_hf(model, directory, *, max_shard_size="5GB", dtype: str | None = None,
            leaves: tuple | None = None) -> None:
    """A bundled model as a Hugging Face directory: a decoder as its family (Llama as
    ``llama``, ...; ``dtype`` None: its checkpoint's), GPT as ``gpt2``. ``leaves``:
    ``(shapes, leaf)``, the parameters read one leaf at a time (a decoder writes them tensor
    by tensor) instead of the model's own."""
    from .gpt import GPT

    if isinstance(model, GPT):
        from .gpt2_hf import save_gpt2

        if leaves is not None:  # GPT-2's exports are small: all leaves, then the model
            import jax
            import numpy as np
            from flax import nnx

            from .hf import _key

            nnx.update(model, jax.tree_util.tree_map_with_path(
                lambda p, v: v.replace(np.asarray(leaves[1](_key(p)))), nnx.state(model, nnx.Param),
                is_leaf=lambda x: isinstance(x, nnx.Variable)))
        return save_gpt2(model, directory, max_shard_size=max_shard_size,
                         dtype=dtype or "float32")
    return model.save_pretrained(directory, max_shard_size=max_shard_size, dtype=dtype,
                                 leaves=leaves)
