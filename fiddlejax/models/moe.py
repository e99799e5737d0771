"""A mixture-of-experts MLP: a top-k router, SwiGLU experts with stacked weights, and dispatch.

Routing follows transformers exactly (``modeling_mixtral.py``, ``modeling_qwen3_moe.py``):
router logits ``x @ W`` in the activation's dtype; scores in float32 (softmax, or sigmoid for
the DeepSeek-V3 style); the top-k scores become the gates, divided by their sum when
``norm_topk_prob`` (Mixtral always; Qwen3-MoE as its config says).

Experts are ``E`` SwiGLU MLPs whose weights are stacked: ``w_gate``, ``w_up`` ``[E, d, f]``
named ``("expert", "embed", "mlp")`` and ``w_down`` ``[E, f, d]`` named ``("expert", "mlp",
"embed")``, so the ``tensor`` axis splits every expert's matrices Megatron-style (gate and up
column-parallel, down row-parallel) and an ``expert`` axis can split the experts themselves.

Dispatch (``MoEConfig.dispatch``):

- ``"dropless"`` (default): the ``N * k`` (token, choice) pairs sorted by expert, three grouped
  matmuls (each expert multiplies only its own rows), unsorted by a scatter-add weighted by the
  gates. Nothing is dropped, whatever the routing. ``grouped_matmul``: ``"ragged_dot"``
  (``jax.lax.ragged_dot``: a grouped-matmul kernel on GPU and TPU, but a dense masked matmul
  over every expert elsewhere), ``"blocked"`` (a loop over row blocks of one expert each, any
  backend) or ``"auto"`` (the first on GPU and TPU, the second elsewhere).
- ``"capacity"``: in each sequence (the ``T`` axis of ``[..., T, d]``), each expert takes at
  most ``ceil(capacity_factor * T * k / E)`` pairs into a fixed ``[E, C, d]`` buffer (static
  shapes, batched matmuls); first choices win over second ones, then earlier tokens; the rest
  are dropped (they add nothing to the output) and counted. Per sequence, so the same tokens
  drop however a layout splits the batch into microbatches and shards.
- ``"dense"``: every expert computes every token and the gates mask the results (the
  one-hot baseline of ``benchmarks/moe_dispatch.py``; exact, ``E / k`` times the FLOPs).

The layer returns :class:`MoEOutput`: the output, the router logits (as transformers'
``output_router_logits``), the chosen experts and the per-token dropped count. How the router
losses travel through a pipeline is :mod:`.moe_loss`'s concern.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax import intercept
from fiddlejax.memory import names
from fiddlejax.parallel import expert
from fiddlejax.parallel.ops import Ops

from .common import param
from .grouped import BLOCK, blocked

SCORINGS = ("softmax", "sigmoid")
DISPATCHES = ("dropless", "capacity", "dense")
GROUPED = ("auto", "ragged_dot", "blocked")
ACTIVATIONS = {"silu": jax.nn.silu}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Field names follow transformers' configs (``num_experts`` is Mixtral's
    ``num_local_experts``; ``intermediate_size`` one expert's width, Qwen3-MoE's
    ``moe_intermediate_size``). ``capacity_factor`` is read only by ``dispatch="capacity"``.
    ``router_aux_loss_coef`` and ``router_z_loss_coef`` weight the losses of :mod:`.moe_loss`.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    dispatch: str = "dropless"
    capacity_factor: float | None = None
    grouped_matmul: str = "auto"
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    hidden_act: str = "silu"

    def __post_init__(self):
        me = type(self).__name__
        for f in ("hidden_size", "intermediate_size", "num_experts", "num_experts_per_tok"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{me}.{f}={v!r} must be a positive int")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{me}.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}; pick at most {self.num_experts}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"{me}.scoring={self.scoring!r}; use one of {SCORINGS}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"{me}.dispatch={self.dispatch!r}; use one of {DISPATCHES}")
        if self.grouped_matmul not in GROUPED:
            raise ValueError(f"{me}.grouped_matmul={self.grouped_matmul!r}; use one of {GROUPED}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"{me}.hidden_act={self.hidden_act!r}; supported: "
                             f"{tuple(ACTIVATIONS)}")
        cf = self.capacity_factor
        if self.dispatch == "capacity" and (not isinstance(cf, int | float) or cf <= 0):
            raise ValueError(f"{me}.capacity_factor={cf!r}: dispatch='capacity' needs a "
                             "positive factor, e.g. 1.25")
        if self.dispatch != "capacity" and cf is not None:
            raise ValueError(f"{me}.capacity_factor={cf!r} is read only by "
                             f"dispatch='capacity' (got dispatch={self.dispatch!r}); set "
                             "dispatch='capacity' or drop the factor")
        for f in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, f) < 0:
                raise ValueError(f"{me}.{f}={getattr(self, f)!r} must be >= 0")

    def capacity(self, tokens: int) -> int:
        """Pairs one expert takes from a sequence of ``tokens`` under ``dispatch="capacity"``:
        ``ceil(factor * tokens * k / E)``, at most ``tokens`` (one pair per token)."""
        k, e = self.num_experts_per_tok, self.num_experts
        return max(1, min(tokens, math.ceil(self.capacity_factor * tokens * k / e)))


class MoEOutput(NamedTuple):
    """What an MoE layer returns (unpacks like a tuple)."""

    output: jax.Array         # [..., d], the activation's dtype
    router_logits: jax.Array  # [..., E], the activation's dtype (transformers' router_logits)
    experts: jax.Array        # [..., k] int32, the chosen experts, best first
    dropped: jax.Array        # [...] int32, this token's choices dropped (0 unless capacity)


def route(logits: jax.Array, top_k: int, scoring: str = "softmax",
          norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(gates, experts)``, ``[..., k]`` float32 and int32, of router ``logits [..., E]``:
    the top-k float32 scores (softmax or sigmoid), divided by their sum if
    ``norm_topk_prob``. Gates carry gradients to the router as in transformers."""
    l32 = logits.astype(jnp.float32)
    scores = jax.nn.softmax(l32, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(l32)
    gates, experts = jax.lax.top_k(scores, top_k)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return gates, experts.astype(jnp.int32)


def _swiglu(h_gate: jax.Array, h_up: jax.Array, act) -> jax.Array:
    return act(checkpoint_name(h_gate, names.MLP_HIDDEN)) * checkpoint_name(h_up, names.MLP_HIDDEN)


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """``(order, sizes)`` of the ``N * k`` pairs of ``experts [N, k]``, numbered choice-major
    (pair ``j * N + n`` is token ``n``'s ``j``-th choice): ``order`` sorts them by expert,
    stably (first choices, then earlier tokens first); ``sizes[e]`` counts expert ``e``'s."""
    flat = experts.T.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, sizes


def blocked_matmuls(xs: jax.Array, sizes: jax.Array, ws: tuple, act, block: int = BLOCK,
                    most: jax.Array | None = None) -> jax.Array:
    """The SwiGLU experts ``ws`` on rows ``xs`` sorted by expert, by :func:`blocked`."""
    return blocked(xs, sizes, ws, lambda xb, w: _swiglu(xb @ w[0], xb @ w[1], act) @ w[2],
                   block, most)


def grouped_kind(grouped: str) -> str:
    """``MoEConfig.grouped_matmul`` resolved: ``auto`` is ``ragged_dot`` on GPU and TPU and
    ``blocked`` elsewhere, where ``ragged_dot`` is a dense masked matmul over every expert."""
    if grouped != "auto":
        return grouped
    return "ragged_dot" if jax.default_backend() in ("gpu", "tpu") else "blocked"


def grouped_swiglu(xs: jax.Array, sizes: jax.Array, ws: tuple, most: jax.Array | None = None,
                   *, act, grouped: str) -> jax.Array:
    """The SwiGLU experts ``ws`` on rows ``xs`` sorted by expert, ``sizes[e]`` rows each:
    ``grouped="ragged_dot"`` or ``"blocked"`` (:func:`blocked_matmuls`; ``most`` as there)."""
    if grouped == "blocked":
        return blocked_matmuls(xs, sizes, ws, act, most=most)
    w_gate, w_up, w_down = ws
    sizes = with_padding(sizes, xs.shape[0])
    h = _swiglu(jax.lax.ragged_dot(xs, w_gate, sizes), jax.lax.ragged_dot(xs, w_up, sizes), act)
    return jax.lax.ragged_dot(h, w_down, sizes)


def with_padding(sizes: jax.Array, rows: int) -> jax.Array:
    """``sizes`` with the rows past their sum (padding) counted in the last group, for
    ``ragged_dot`` (whose groups cover the rows); their outputs are thrown away."""
    return sizes.at[-1].add(rows - jnp.sum(sizes))


def dropless(x: jax.Array, gates: jax.Array, experts: jax.Array, w_gate: jax.Array,
             w_up: jax.Array, w_down: jax.Array, act=jax.nn.silu, grouped: str = "ragged_dot"
             ) -> jax.Array:
    """``sum_j gates[n, j] * expert_{experts[n, j]}(x[n])`` for ``x [N, d]``, each expert
    computing only its own rows (grouped matmuls over the pairs sorted by expert):
    ``grouped="ragged_dot"`` or ``"blocked"`` (:func:`blocked_matmuls`)."""
    n = x.shape[0]
    order, sizes = sort_by_expert(experts, w_gate.shape[0])
    token = order % n
    ys = grouped_swiglu(x[token], sizes, (w_gate, w_up, w_down), act=act, grouped=grouped)
    g = gates.T.reshape(-1)[order].astype(ys.dtype)
    return jnp.zeros_like(x).at[token].add(ys * g[:, None])


def with_capacity(x: jax.Array, gates: jax.Array, experts: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, capacity: int, act=jax.nn.silu
                  ) -> tuple[jax.Array, jax.Array]:
    """:func:`dropless` with at most ``capacity`` pairs per expert, in a fixed ``[E, C, d]``
    buffer; pairs past an expert's capacity are dropped. Returns the output and the
    per-token count of dropped choices ``[N]`` int32."""
    buf, where = capacity_buffer(x, experts, w_gate.shape[0], capacity)
    return capacity_combine(capacity_experts(buf, (w_gate, w_up, w_down), act), gates, where)


def capacity_buffer(x: jax.Array, experts: jax.Array, num_experts: int, capacity: int
                    ) -> tuple[jax.Array, tuple]:
    """One sequence's ``[E, C, d]`` buffer (each expert's first ``capacity`` pairs) and where
    its pairs went, for :func:`capacity_combine`."""
    n, e = x.shape[0], num_experts
    order, sizes = sort_by_expert(experts, e)
    token = order % n
    owner = experts.T.reshape(-1)[order]
    rank = jnp.arange(order.shape[0], dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[owner]
    kept = rank < capacity
    slot = jnp.where(kept, owner * capacity + rank, e * capacity)  # out of range: dropped
    buf = jnp.zeros((e * capacity, x.shape[1]), x.dtype).at[slot].set(x[token], mode="drop")
    return buf.reshape(e, capacity, -1), (order, token, slot, kept)


def capacity_experts(buf: jax.Array, ws: tuple, act) -> jax.Array:
    """The SwiGLU experts on their buffers ``[..., E, C, d]`` (batched matmuls)."""
    w_gate, w_up, w_down = ws
    h = _swiglu(jnp.einsum("...ecd,edf->...ecf", buf, w_gate),
                jnp.einsum("...ecd,edf->...ecf", buf, w_up), act)
    return jnp.einsum("...ecf,efd->...ecd", h, w_down)


def capacity_combine(y: jax.Array, gates: jax.Array, where: tuple
                     ) -> tuple[jax.Array, jax.Array]:
    """The output ``[N, d]`` from the experts' results ``[E, C, d]`` (``gates [N, k]``), and
    each token's dropped choices."""
    order, token, slot, kept = where
    n = gates.shape[0]
    ys = y.reshape(-1, y.shape[-1]).at[slot].get(mode="fill", fill_value=0)
    g = gates.T.reshape(-1)[order].astype(ys.dtype)
    out = jnp.zeros((n, y.shape[-1]), ys.dtype).at[token].add(ys * g[:, None])
    dropped = jnp.zeros((n,), jnp.int32).at[token].add((~kept).astype(jnp.int32))
    return out, dropped


def dense(x: jax.Array, gates: jax.Array, experts: jax.Array, w_gate: jax.Array,
          w_up: jax.Array, w_down: jax.Array, act=jax.nn.silu) -> jax.Array:
    """Every expert on every token, the unchosen ones weighted 0 (one-hot dispatch)."""
    e = w_gate.shape[0]
    weight = jnp.sum(jax.nn.one_hot(experts, e, dtype=gates.dtype) * gates[..., None], axis=-2)
    h = _swiglu(jnp.einsum("nd,edf->enf", x, w_gate), jnp.einsum("nd,edf->enf", x, w_up), act)
    y = jnp.einsum("enf,efd->end", h, w_down)
    return jnp.einsum("end,ne->nd", y, weight.astype(y.dtype))


class MoE(nnx.Module):
    """A mixture-of-experts SwiGLU MLP (see the module docstring); ``[..., d] -> MoEOutput``."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, out_std: float | None = None):
        c = self.config = config
        d, f, e = c.hidden_size, c.intermediate_size, c.num_experts
        normal = jax.nn.initializers.normal
        std = 0.02
        out_std = std if out_std is None else out_std
        self.router = param(rngs, normal(std), (d, e), ("embed", None))
        self.w_gate = param(rngs, normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_up = param(rngs, normal(std), (e, d, f), ("expert", "embed", "mlp"))
        self.w_down = param(rngs, normal(out_std), (e, f, d), ("expert", "mlp", "embed"))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(router logits, gates, experts)`` of tokens ``x [N, d]``."""
        c = self.config
        logits = x @ self.router[...].astype(x.dtype)
        return (logits, *route(logits, c.num_experts_per_tok, c.scoring, c.norm_topk_prob))

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> MoEOutput:
        """Route and run ``x [..., d]``; ``ops.expert`` (what the layout offers; a user's block
        that takes no ``ops`` is reached through :mod:`fiddlejax.intercept`): the experts are
        split over the ``expert`` axis and tokens travel to them."""
        c = self.config
        ops = ops if ops is not None else intercept.current().ops
        ep = None if ops is None else ops.expert
        if x.shape[-1] != c.hidden_size:
            raise ValueError(f"MoE expects [..., {c.hidden_size}] activations "
                             f"(MoEConfig.hidden_size); got {list(x.shape)}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, c.hidden_size)
        logits, gates, experts = self.route(flat)
        ws = (self.w_gate[...], self.w_up[...], self.w_down[...])
        act = ACTIVATIONS[c.hidden_act]
        dropped = jnp.zeros(flat.shape[:1], jnp.int32)
        if c.dispatch == "dropless":
            grouped = grouped_kind(c.grouped_matmul)
            out = (dropless(flat, gates, experts, *ws, act=act, grouped=grouped) if ep is None
                   else expert.dropless(ep, flat, gates, experts, ws, functools.partial(
                       grouped_swiglu, act=act, grouped=grouped)))
        elif c.dispatch == "capacity":  # per sequence: the drops are the same on any layout
            t = x.shape[-2] if x.ndim > 1 else 1
            rows = lambda a: a.reshape(-1, t, *a.shape[1:])  # noqa: E731
            buf, where = jax.vmap(lambda x, i: capacity_buffer(
                x, i, c.num_experts, c.capacity(t)))(rows(flat), rows(experts))
            run = functools.partial(capacity_experts, act=act)
            y = run(buf, ws) if ep is None else expert.with_capacity(ep, buf, ws, run)
            out, dropped = jax.vmap(capacity_combine)(y, rows(gates), where)
            out, dropped = out.reshape(flat.shape), dropped.reshape(-1)
        else:
            out = dense(flat, gates, experts, *ws, act=act)
        out = checkpoint_name(out, names.MLP_OUT)
        k = c.num_experts_per_tok
        return MoEOutput(out.reshape(x.shape), logits.reshape(*lead, -1),
                         experts.reshape(*lead, k), dropped.reshape(lead))
