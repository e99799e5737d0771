"""LoRA: low-rank adapters trained on a frozen base (Hu et al. 2021), on every layout.

Design. An adapter is two ordinary parameters next to the kernel it adapts, named after it:
``wq_lora_a`` (the kernel's input dims + ``rank``) and ``wq_lora_b`` (``rank`` + its output
dims), carrying the kernel's logical axis names on those dims, so tensor, pipeline and FSDP
shard them as they shard the kernel, and checkpoints hold them with the state. A layer computes
``x @ W + (alpha / rank) * (x @ A) @ B`` (:func:`fiddlejax.models.common.project`); B starts at
zero (the model is the base at step 0), A as peft's ``kaiming_uniform(a=sqrt(5))``.

A model with adapters trains only them, whatever the layout; nothing hidden carries the choice,
the parameter names do (``*lora_a`` / ``*lora_b``: also ``flax.nnx.LoRA``'s, so a user's NNX
model wrapped with ``nnx.LoRA`` / ``nnx.LoRALinear`` is frozen the same way):

- :func:`lay_out` wraps the staged model so every function of it (prologue, each layer, head
  and loss) sees the frozen parameters through ``lax.stop_gradient``: autodiff never forms
  their weight gradients (no ``T x d x d`` matmul, no gather transposed into a reduce-scatter),
  on the data path and in every pipeline schedule alike; the adapters' ``dA, dB`` cost
  ``O(T d r)``;
- :func:`drop_frozen` keeps their (zero) gradients out of the microbatch sums and
  :func:`reduce_frozen` gives them back without an all-reduce (the data path; a pipeline
  sums them as zeros);
- :func:`optimizer` gives them no optimizer state (``optax.multi_transform`` with
  ``set_to_zero``: an ``optax.MaskedNode``, which the ZeRO shardings and the canonical
  conversions already pass through), so they stay bit-for-bit the base.

:func:`add` puts adapters on a bundled model (the modules that declare ``lora_targets``) or
on a user's own (its ``nnx.Linear`` layers named like the targets become :class:`LoRALinear`);
:func:`merge` folds them into the base for export (``W + (alpha / rank) A @ B``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

SUFFIXES = ("lora_a", "lora_b")
DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # attention and MLP projections


@dataclasses.dataclass(frozen=True)
class LoRA:
    """What :func:`add` puts on a model: ``rank``, ``alpha`` (the update is scaled by
    ``alpha / rank``), ``dropout`` (peft's ``lora_dropout``, on the adapters' input; masks
    per example, the same on every layout: :mod:`fiddlejax.adaptation.dropout`) and the
    ``targets``, kernels by attribute name (Meta's: ``wq wk wv wo`` attention, ``w1 w3 w2``
    gate, up, down; Hugging Face's ``q_proj`` ... ``down_proj`` are accepted too)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be a positive integer, e.g. 16")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be positive, e.g. 2 * rank")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} must be in [0, 1), e.g. 0.05")
        names = tuple(HF_NAMES.get(t, t) for t in self.targets)
        if not names:
            raise ValueError("LoRA targets is empty; name kernels, e.g. [wq, wv]")
        object.__setattr__(self, "targets", names)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


HF_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1",
            "up_proj": "w3", "down_proj": "w2", "q_a_proj": "wq_a", "q_b_proj": "wq_b",
            "kv_a_proj_with_mqa": "wkv_a", "kv_b_proj": "wkv_b"}  # the last four: MLA's


# -- which parameters train -------------------------------------------------------------------
def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", ""))))


def is_adapter(path) -> bool:
    """Whether a tree path names an adapter (a key ``lora_a``/``lora_b`` or ending so)."""
    return any(_key(e).endswith(SUFFIXES) for e in path)


def has_adapters(tree) -> bool:
    """Whether ``tree`` (parameters, any layout) holds adapters: then only they train."""
    return any(is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def freeze(tree):
    """``tree`` with every non-adapter leaf behind ``stop_gradient`` (same values)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if is_adapter(p) else jax.lax.stop_gradient(x), tree)


def labels(tree):
    """``"train"`` for the adapters, ``"frozen"`` for the rest (``optax.multi_transform``)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, _: "train" if is_adapter(p) else "frozen", tree)


def optimizer(opt: optax.GradientTransformation) -> optax.GradientTransformation:
    """``opt`` on the adapters alone; the frozen base gets no state and a zero update."""
    return optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)


def reduce_frozen(grads, dims, reduce_leaf):
    """``reduce_leaf(g, d)`` applied to the adapters' gradients (``dims``: one FSDP dimension
    per leaf); the base's (zeros: nothing flowed into them) come back as fresh zeros, without
    a collective."""
    return jax.tree_util.tree_map_with_path(
        lambda p, g, d: reduce_leaf(g, d) if is_adapter(p) else jnp.zeros(g.shape, g.dtype),
        grads, dims)


def drop_frozen(tree):
    """``tree`` with the non-adapter leaves removed (None): what a microbatch loop sums."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if is_adapter(p) else None, tree)


def fill_frozen(dropped, like, dtype):
    """:func:`drop_frozen`'s tree made whole again on ``like``'s structure, the removed leaves
    fresh zeros of ``dtype(leaf)``."""
    found = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(dropped)}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: found[jax.tree_util.keystr(p)] if is_adapter(p)
        else jnp.zeros(x.shape, dtype(x)), like)


class Frozen:
    """A staged model whose functions see the non-adapter parameters as constants."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prologue(self, params, batch):
        return self._inner.prologue(freeze(params), batch)

    def layer(self, layer_params, x):
        return self._inner.layer(freeze(layer_params), x)

    def weighted_loss(self, params, x, batch):
        return self._inner.weighted_loss(freeze(params), x, batch)

    def epilogue(self, params, x, batch):
        return self._inner.epilogue(freeze(params), x, batch)

    def outputs(self, params, x, batch):
        return self._inner.outputs(freeze(params), x, batch)


def adapters_off(tree):
    """``tree`` with every ``lora_b`` zero: the frozen base (``x @ W + scale * (x A) 0``)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if any(_key(e).endswith("lora_b") for e in p) else x,
        tree)


def lay_out(staged, canonical):
    """The freezing step of :func:`fiddlejax.parallel.compose.lay_out`: ``staged`` itself for
    a model without adapters."""
    return Frozen(staged) if has_adapters(canonical) else staged


# -- adapters on a model ----------------------------------------------------------------------
def add(model: nnx.Module, lora: LoRA, seed: int = 0) -> nnx.Module:
    """Put adapters on ``model``'s target kernels, in place; returns ``model``.

    A module declares what may be adapted as ``lora_targets = {name: (input dims, output
    dims)}`` (leading dims beyond those, e.g. the stacked ``layers``, are kept) and reads its
    kernels with :func:`fiddlejax.models.common.project`. A model that declares none (a user's
    own) gets a :class:`LoRALinear` in place of each ``nnx.Linear`` named like a target."""
    key, found = jax.random.key(seed), []
    bundled = any(getattr(type(m), "lora_targets", {}) for _, m in nnx.iter_modules(model))
    if bundled and lora.dropout:
        if not getattr(type(model), "dropout_keys", False):
            raise ValueError(f"LoRA dropout={lora.dropout} on {type(model).__name__}: its "
                             "layers take no per-example dropout keys (the decoder families "
                             "do); use dropout=0 (plan.lora.dropout=0)")
        model.dropout_seed = seed  # its prologue folds per-example keys from it
    for path, module in nnx.iter_modules(model):
        table = getattr(type(module), "lora_targets", {})
        for name in lora.targets:
            if name not in table or not isinstance(getattr(module, name, None), nnx.Param):
                continue
            key, sub = jax.random.split(key)
            _adapt(module, name, table[name][0], lora.rank, sub)
            found.append(".".join(map(str, (*path, name))))
        if any(n in table for n in lora.targets):
            module.lora_scale, module.lora_dropout = lora.scale, lora.dropout
    have = sorted({n for _, m in nnx.iter_modules(model)
                   for n in getattr(type(m), "lora_targets", {})})
    if not have:  # a user's own model: its nnx.Linear layers named like the targets
        found = _wrap_linears(model, lora, key)
    if not found:
        linears = sorted({str(p[-1]) for p, m in nnx.iter_modules(model)
                          if isinstance(m, nnx.Linear) and p})
        raise ValueError(
            f"LoRA targets {list(lora.targets)} match no kernel of {type(model).__name__}; "
            + (f"it has {have}" if have else f"its nnx.Linear layers are named {linears}: "
               "name those (plan.lora.targets=[...])"))
    return model


def _peft_a_init(key, shape, dtype):
    """``kaiming_uniform(a=sqrt(5))`` over the fan-in ``shape[0]``, as peft initializes A."""
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRALinear(nnx.LoRALinear):
    """flax's ``nnx.LoRALinear`` with peft's scale and dropout on the adapters' input:
    ``x @ W + b + (alpha / rank) (dropout(x) @ A) @ B`` (the parameters keep flax's names:
    ``kernel``, ``bias``, ``lora.lora_a``, ``lora.lora_b``). Through ``layers=`` the dropout is
    fiddlejax's layout-independent one (:mod:`fiddlejax.adaptation.dropout`)."""

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
        return y + (self.lora_scale * self.lora(self.lora_dropout(x))).astype(y.dtype)


def _wrap_linears(model: nnx.Module, lora: LoRA, key) -> list[str]:
    """Replace each ``nnx.Linear`` attribute named like a target (its own name or its Hugging
    Face twin: ``q_proj`` is ``wq``) by a :class:`LoRALinear` holding the same kernel and bias;
    the adapters carry the kernel's sharding names on the dims they share with it."""
    hits = [(path, module, name) for path, module in nnx.iter_modules(model)
            for name, value in list(vars(module).items())
            if isinstance(value, nnx.Linear) and not isinstance(value, nnx.LoRALinear)
            and HF_NAMES.get(name, name) in lora.targets]
    for _, module, name in hits:
        base = getattr(module, name)
        axes = base.kernel.get_metadata().get("out_sharding")
        key, sub = jax.random.split(key)
        meta = ({"out_sharding": (axes[0], None), "eager_sharding": False},
                {"out_sharding": (None, axes[1]), "eager_sharding": False}) if axes else ({}, {})
        new = LoRALinear(base.in_features, base.out_features, lora_rank=lora.rank,
                         use_bias=base.use_bias, dtype=base.dtype, param_dtype=base.param_dtype,
                         precision=base.precision, rngs=nnx.Rngs(sub),
                         a_initializer=_peft_a_init,
                         a_metadata=meta[0], b_metadata=meta[1])
        new.kernel, new.bias, new.lora_scale = base.kernel, base.bias, lora.scale
        new.lora_dropout = nnx.Dropout(lora.dropout, rngs=nnx.Rngs(dropout=sub))
        setattr(module, name, new)
    return [".".join(map(str, (*path, name))) for path, _, name in hits]


def _adapt(module: nnx.Module, name: str, n_in: int, rank: int, key) -> None:
    base = getattr(module, name)
    axes = tuple(base.get_metadata().get("out_sharding") or (None,) * base.ndim)
    lead = base.ndim - n_in - type(module).lora_targets[name][1]  # stacked dims (layers)
    shape = base.shape
    fan_in = math.prod(shape[lead:lead + n_in])
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)), as peft initializes A
    a = jax.random.uniform(key, (*shape[:lead + n_in], rank), jnp.float32, -bound, bound)
    b = jnp.zeros((*shape[:lead], rank, *shape[lead + n_in:]), jnp.float32)
    setattr(module, f"{name}_lora_a", nnx.Param(
        a.astype(base.dtype), out_sharding=(*axes[:lead + n_in], None), eager_sharding=False))
    setattr(module, f"{name}_lora_b", nnx.Param(
        b.astype(base.dtype), out_sharding=(*axes[:lead], None, *axes[lead + n_in:]),
        eager_sharding=False))


def merge(params: dict, scale: float) -> dict:
    """Flat ``{key: array}`` parameters (keys tuples or dotted strings) with each adapter
    pair folded into its kernel and removed."""
    shapes = {k: np.shape(v) for k, v in params.items()}
    shapes, leaf = merged_leaves(shapes, params.__getitem__, scale)
    return {k: leaf(k) for k in shapes}


def merged_leaves(shapes: dict, leaf, scale: float):
    """``(shapes, leaf)`` of flat parameters read one at a time, the adapters folded into
    their kernels (``W + scale * A @ B`` over stacked leading dims), for export: a stacked
    kernel is folded a layer at a time as it is indexed (:class:`_Merged`)."""
    def suffixed(k, s):
        return (*k[:-1], k[-1] + s) if isinstance(k, tuple) else k + s

    def named(k) -> str:
        return k[-1] if isinstance(k, tuple) else k

    kept = {k: v for k, v in shapes.items() if not named(k).endswith(SUFFIXES)}

    def merged(k):
        w = leaf(k)
        if suffixed(k, "_lora_a") not in shapes:
            return w
        a, b = np.asarray(leaf(suffixed(k, "_lora_a"))), np.asarray(leaf(suffixed(k, "_lora_b")))
        return _Merged(w, a, b, scale)

    return kept, merged


class _Merged:
    """Kernel ``w`` with its adapters ``a``, ``b`` folded in: ``x[i]`` folds layer ``i`` alone
    (reading that layer of ``w`` alone when it is still on disk), ``np.asarray(x)`` all."""

    def __init__(self, w, a: np.ndarray, b: np.ndarray, scale: float):
        self.w, self.a, self.b, self.scale = w, a, b, scale
        self.shape = tuple(w.shape)
        self.lead = a.ndim + b.ndim - 2 - len(self.shape)  # a: lead+in+[r], b: lead+[r]+out

    def _fold(self, w: np.ndarray, a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
        aa = a.reshape(*w.shape[:lead], -1, a.shape[-1]).astype(np.float32)
        bb = b.reshape(*w.shape[:lead], b.shape[lead], -1).astype(np.float32)
        return (w.astype(np.float32) + self.scale * (aa @ bb).reshape(w.shape)).astype(w.dtype)

    def __getitem__(self, i) -> np.ndarray:
        if self.lead < 1 or not isinstance(i, int | np.integer):
            return np.asarray(self)[i]
        return self._fold(np.asarray(self.w[i]), self.a[i], self.b[i], self.lead - 1)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self._fold(np.asarray(self.w), self.a, self.b, self.lead)
        return whole if dtype is None else whole.astype(dtype)


# our kernel -> the Hugging Face module it is (PEFT's target_modules names)
PEFT_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w3": "mlp.up_proj",
                "w2": "mlp.down_proj"}


def peft_adapter(shapes: dict, leaf, settings: LoRA, base: str | None) -> tuple[dict, dict]:
    """(tensors, adapter_config) of a PEFT LoRA adapter from flat parameters read one at a
    time (keys ``("blocks", "wq_lora_a")``, stacked on the layer axis): PEFT's
    ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
    ``lora_B.weight`` ``[out, r]``, so ``W x + (alpha / r) B A x`` is ours (a Hugging Face
    weight is our kernel flattened to ``[in, out]`` and transposed; nothing is permuted)."""
    tensors, modules = {}, set()
    for k in sorted(shapes, key=str):
        name = k[-1] if isinstance(k, tuple) else k
        if not name.endswith("_lora_a"):
            continue
        kernel = name[: -len("_lora_a")]
        if tuple(k[:-1]) != ("blocks",) or kernel not in PEFT_MODULES:
            raise ValueError(f"an adapter on {k} has no PEFT module here (the attention and "
                             f"MLP projections {sorted(PEFT_MODULES)} of a decoder's layers); "
                             "export the merged model instead (without --adapter)")
        a = np.asarray(leaf(k), np.float32)
        b = np.asarray(leaf((*k[:-1], kernel + "_lora_b")), np.float32)
        module = PEFT_MODULES[kernel]
        modules.add(module.split(".")[-1])
        for i in range(a.shape[0]):
            pre = f"base_model.model.model.layers.{i}.{module}"
            r = a.shape[-1]
            tensors[f"{pre}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[f"{pre}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    if not tensors:
        raise ValueError("the run has no LoRA adapters (plan.lora was null); --adapter writes "
                         "a PEFT adapter of a plan.lora run")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": settings.rank, "lora_alpha": settings.alpha,
              "lora_dropout": settings.dropout, "target_modules": sorted(modules),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}
    return tensors, config


def trainable_count(tree) -> tuple[int, int]:
    """``(adapter parameters, all parameters)`` of a parameter tree (arrays or shapes)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    n = lambda x: int(np.prod(np.shape(x)))
    return (sum(n(x) for p, x in leaves if is_adapter(p)), sum(n(x) for _, x in leaves))


def targets_of(value: str | Iterable[str]) -> tuple[str, ...]:
    """Targets from a config value: a list, or a comma/space-separated string."""
    if isinstance(value, str):
        return tuple(t for t in value.replace(",", " ").split() if t)
    return tuple(value)
