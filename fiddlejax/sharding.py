"""Logical axis names -> mesh ``PartitionSpec``s.

Models annotate parameters with logical names (``out_sharding`` metadata such as
``("embed", "mlp")``); the rules below map them to mesh axes, giving Megatron's tensor
parallelism: attention heads and the MLP hidden dimension are split over ``tensor``
(column-parallel in, row-parallel out) and the vocabulary is split over ``tensor``
(vocabulary-parallel embedding and head).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

# Logical axis -> mesh axis (None: replicated).
DEFAULT_RULES: Mapping[str, str | None] = {
    "batch": "data",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",  # grouped-query attention's key/value heads
    "mlp": "tensor",
    "expert": "expert",  # an MoE layer's stacked experts (fiddlejax.parallel.expert)
    "embed": None,
    "head_dim": None,
    "layers": None,
    "seq": None,
    "channels": None,
    "height": None,
    "width": None,
    "classes": None,
}


def logical_to_spec(
    names: Sequence[str | None] | None, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> P:
    """Map a tuple of logical axis names to a ``PartitionSpec`` through ``rules``."""
    if not names:
        return P()
    out = []
    for n in names:
        if n is None:
            out.append(None)
        elif n in rules:
            out.append(rules[n])
        else:
            raise ValueError(
                f"logical axis {n!r} has no sharding rule; known: {sorted(rules)}. "
                "Add it to the rules or use one of the known names"
            )
    return P(*out)


def logical_names(state: nnx.State) -> nnx.State:
    """The logical ``out_sharding`` names of every variable (``()`` when unannotated)."""

    def names(v):
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        return tuple(meta.get("out_sharding") or ())

    return jax.tree.map(names, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_specs(
    state: nnx.State, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> nnx.State:
    """A ``PartitionSpec`` per variable of ``state`` (an ``nnx.state(model, ...)`` tree)."""

    def spec(v):
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        return logical_to_spec(meta.get("out_sharding"), rules)

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# -- models without annotations, and annotations that do not fit --------------------------------
def user_stacklevel() -> int:
    """The ``stacklevel`` at which a warning points at the first frame outside fiddlejax (the
    user's call), however deep inside the library it is raised."""
    import sys

    root = str(Path(__file__).resolve().parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names(v) -> tuple:
    return tuple(v.get_metadata().get("out_sharding") or ()) if _is_var(v) else ()


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def annotate(model: nnx.Module, table: Mapping[str, Sequence[str | None]]) -> list[str]:
    """Give parameters logical axis names by a rule table, without changing the model's code.

    ``table`` maps a regular expression on the parameter path (``"blocks/0/attn/q/kernel"``:
    attribute names and list indices joined by ``/``) to its logical names, as MaxText and
    EasyDeL do: ``{r"attn/(q|k|v)/kernel": ("embed", "heads"), r"mlp/up/kernel": ("embed",
    "mlp")}``. The first matching rule wins; it replaces the parameter's own names. Returns the
    paths it named; a rule that matches nothing is an error (a typo would silently replicate).
    """
    import re

    rules = [(re.compile(k), tuple(v)) for k, v in table.items()]
    used, named = set(), []
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        p = "/".join(str(k) for k in path)
        for i, (rx, names) in enumerate(rules):
            if rx.search(p):
                if len(names) != v.ndim:
                    raise ValueError(f"rule {rx.pattern!r} names {len(names)} axes {names} for "
                                     f"{p}, which has shape {tuple(v.shape)}; give one name "
                                     "(or None) per dimension")
                v.set_metadata(out_sharding=names)
                used.add(i)
                named.append(p)
                break
    unused = [rx.pattern for i, (rx, _) in enumerate(rules) if i not in used]
    if unused:
        raise ValueError(f"sharding rules {unused} match no parameter of "
                         f"{type(model).__name__}; paths look like {named[:1] or 'a/b/kernel'}")
    return named


def check_ranks(params: nnx.State, model_name: str) -> None:
    """A parameter whose logical names do not match its rank would be sharded on the wrong
    dimensions; raise naming it. Names that are all ``None`` shard nothing and pass."""
    for path, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]:
        names = _names(v)
        if names and any(n is not None for n in names) and len(names) != v.ndim:
            raise ValueError(
                f"{model_name}: parameter {_path(path)} has shape {tuple(v.shape)} but "
                f"{len(names)} sharding names {names}; name every dimension (a stack built with "
                "nnx.vmap needs transform_metadata={nnx.PARTITION_NAME: 'layers'}), or override "
                "the names with fj.sharding.annotate(model, {regex: names})")


def name_stack(model: nnx.Module, stack: str) -> None:
    """Prepend ``"layers"`` to the names of stacked parameters that lack it (a stack built
    without ``nnx.PARTITION_NAME``), which would otherwise shift every name by one dimension.
    Writes the names into the model's variables, as :func:`annotate` does."""
    fixed = []
    for path, v in nnx.to_flat_state(nnx.state(getattr(model, stack), nnx.Param)):
        names = _names(v)
        if names and len(names) == v.ndim - 1 and names[0] != "layers":
            v.set_metadata(out_sharding=("layers", *names))
            fixed.append("/".join(map(str, path)))
    if fixed:
        warnings.warn(f"{type(model).__name__}.{stack}: {len(fixed)} stacked parameters lack the "
                      f"'layers' name of their leading axis (e.g. {fixed[0]}); fiddlejax added "
                      "it. Build the stack with transform_metadata={nnx.PARTITION_NAME: "
                      "'layers'}", stacklevel=user_stacklevel())


# Fused projections (q, k and v side by side) are left replicated: splitting their output over
# `tensor` would cut across the q/k/v boundaries (d, 2d are not shard boundaries), which GSPMD
# reshards with collective-permutes; so is their attention's output projection, whose split
# would propagate back into the fused split.
_FUSED = ("qkv", "c_attn", "wqkv", "qkv_proj", "in_proj", "attn_qkv", "query_key_value")
_COLUMN = ("q", "k", "v", "query", "key", "value", "wq", "wk", "wv", "up", "gate",
           "wi", "wi_0", "wi_1", "fc1", "c_fc", "linear1", "q_proj", "k_proj",
           "v_proj", "up_proj", "gate_proj", "w1", "w3", "intermediate", "fc_in")
_ROW = ("o", "out", "output", "wo", "proj", "down", "fc2", "c_proj", "linear2", "o_proj",
        "down_proj", "out_proj", "dense", "w2", "fc_out")


def _width(flat: list) -> tuple[int | None, int | None]:
    """(vocabulary, model width): from a 2-D ``embedding`` when there is one, else the width is
    the dimension the blocks' projections share most (every q/k/v/o, up/down kernel has it)."""
    embeds = [v.shape for p, v in flat if p[-1] == "embedding" and v.ndim == 2]
    if embeds:
        return max(embeds)
    counts: dict[int, int] = {}
    for p, v in flat:
        if p[-1] == "kernel" and v.ndim in (2, 3):
            for dim in {v.shape[0], v.shape[-1]}:
                counts[dim] = counts.get(dim, 0) + 1
    if not counts:
        return None, None
    return None, max(counts, key=lambda dim: (counts[dim], dim))


def _kernel_names(p: tuple, s: tuple, vocab: int | None, d: int, fused: set) -> tuple | None:
    """Megatron names for one kernel of shape ``s`` at path ``p`` (None: replicated)."""
    leaf, owner = p[-1], p[-2] if len(p) > 1 else ""
    if leaf != "kernel" or owner in _FUSED or (owner in _ROW and p[:-2] in fused):
        return None
    if len(s) == 2 and d in s:
        other = s[1] if s[0] == d else s[0]
        if vocab is None and owner not in _COLUMN + _ROW and other % d:
            return None  # no vocabulary: a classifier's (d, classes) stays whole
        if s[0] == d and vocab is not None and s[1] == vocab and owner not in _COLUMN:
            return ("embed", "vocab")
        if s[0] == d and (s[1] > d or owner in _COLUMN):  # into a wider dimension
            return ("embed", "mlp")
        if s[1] == d and (s[0] > d or owner in _ROW):  # back from one
            return ("mlp", "embed")
    elif len(s) == 3 and s[0] == d:
        return ("embed", "heads", "head_dim")
    elif len(s) == 3 and s[2] == d:
        return ("heads", "head_dim", "embed")
    return None


def _expert_names(p: tuple, s: tuple, d: int) -> tuple | None:
    """An MoE layer's stacked experts (a path naming ``expert``, three dimensions, the model
    width after the first): split over ``expert``, each expert Megatron-style inside."""
    if len(s) != 3 or s[0] == d or d not in s[1:] or not any("expert" in k.lower() for k in p):
        return None
    return ("expert", "embed", "mlp") if s[1] == d else ("expert", "mlp", "embed")


def infer_names(model: nnx.Module) -> dict[str, tuple]:
    """Logical names for a model that has none, from its parameters' shapes and names
    (Megatron's layout). The model width is the vocabulary embedding's, or else the dimension
    the blocks' projections share; kernels into a wider or a ``q/k/v/up/gate`` dimension are
    column-parallel ``(embed, mlp)``; kernels back to the width (``o/out/down/proj``)
    row-parallel ``(mlp, embed)``; attention kernels ``[embed, heads, head_dim]`` split on
    heads; the vocabulary embedding and projection on ``vocab``; biases like their kernel's
    output; fused q/k/v kernels (and their output projection), convolutions (``nnx.Conv``,
    whose ``[window, in, out]`` kernel is not attention's ``[embed, heads, head_dim]``), norms
    and everything else replicated; an MoE layer's stacked experts ``[E, d, f]`` /
    ``[E, f, d]`` (a path naming ``expert``) ``(expert, embed, mlp)`` /
    ``(expert, mlp, embed)``. A parameter the user (or the model) named keeps its names; the
    others are inferred around it. Writes the names into the model's variables (as
    :func:`annotate` does), warns with what it split and how, and returns ``{path: names}``
    of the inferred ones."""
    flat = [(tuple(str(k) for k in p), v)
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    user = {p: _names(v) for p, v in flat if any(n is not None for n in _names(v))}
    if len(user) == len(flat):
        return {}  # all annotated: the model's names stand
    vocab, d = _width(flat)
    if d is None:
        return {}
    fused = {p[:-2] for p, _ in flat if len(p) > 1 and p[-2] in _FUSED}
    convs = {tuple(str(k) for k in path) for path, m in nnx.iter_graph(model)
             if isinstance(m, nnx.Conv | nnx.ConvTranspose)}
    named: dict[tuple, tuple] = {}
    for p, v in flat:
        if p[:-1] in convs or p in user:  # a conv's (*window, in, out): kept whole
            continue
        if p[-1] == "embedding" and vocab is not None and tuple(v.shape) == (vocab, d):
            named[p] = ("vocab", "embed")
        elif (names := _expert_names(p, tuple(v.shape), d)) is not None:
            named[p] = names
        elif (names := _kernel_names(p, tuple(v.shape), vocab, d, fused)) is not None:
            named[p] = names
    for p, v in flat:  # biases follow their kernel's output dimensions
        kernel = named.get((*p[:-1], "kernel")) or user.get((*p[:-1], "kernel"))
        if p[-1] == "bias" and p not in user and kernel and v.ndim <= len(kernel):
            named[p] = kernel[len(kernel) - v.ndim:]
    for p, v in flat:
        if p in named:
            v.set_metadata(out_sharding=named[p])
    out = {"/".join(p): n for p, n in named.items()}
    if user and out:
        warnings.warn(f"{type(model).__name__}: {len(user)} parameters keep the names given; "
                      f"fiddlejax inferred the other {len(flat) - len(user)} (model width {d}): "
                      f"{describe_split(out, len(flat) - len(user))}. Override with "
                      "fj.sharding.annotate(model, {regex: names})",
                      stacklevel=user_stacklevel())
    elif not user:
        warnings.warn(f"{type(model).__name__} has no sharding names; fiddlejax inferred them "
                      f"(model width {d}): {describe_split(out, len(flat))}. Override with "
                      "fj.sharding.annotate(model, {regex: names})",
                      stacklevel=user_stacklevel())
    return out


_HOW = {"expert": "split over experts", "mlp": "column-parallel", "heads": "split over heads",
        "vocab": "vocabulary-parallel"}


def describe_split(named: Mapping[str, tuple], total: int) -> str:
    """One line: which parameters are split and how, paths with their list indices as ``*``
    (``blocks/*/attn/query/kernel``), and how many stay replicated."""
    import re

    groups: dict[str, list[str]] = {}
    for path, names in named.items():
        first = next((n for n in names if n in _HOW), None)
        if first is None or path.endswith("bias"):
            continue
        how = ("row-parallel" if first == "mlp" and names.index("mlp") == 0 and len(names) == 2
               else _HOW[first])
        short = re.sub(r"(^|/)\d+(?=/|$)", r"\1*", path)
        if short not in groups.setdefault(f"{how} {names}", []):
            groups[f"{how} {names}"].append(short)
    split = sum(1 for names in named.values() if any(n in _HOW for n in names))
    if not groups:
        return f"none of its {total} parameters is split over `tensor`"
    parts = "; ".join(f"{how}: {', '.join(paths)}" for how, paths in groups.items())
    return f"{split} of {total} parameters split over `tensor` ({parts}); the rest replicated"


def tensor_unused(spec_tree: Any, tensor: int, model_name: str) -> None:
    """Warn when ``tensor > 1`` but no parameter is split over ``tensor``: every weight would be
    replicated and the tensor axis would only repeat work."""
    if tensor <= 1:
        return
    for spec in jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P)):
        for ax in spec:
            if ax == "tensor" or (isinstance(ax, tuple) and "tensor" in ax):
                return
    warnings.warn(f"tensor={tensor}, but no parameter of {model_name} is mapped to the tensor "
                  "axis (no sharding names, or rules that map none to 'tensor'): every weight is "
                  "replicated. Annotate with fj.sharding.annotate(model, {regex: names}) or map "
                  "the model's names with Plan(rules={name: 'tensor'})",
                  stacklevel=user_stacklevel())
