"""DeepSeek-V3's mixture of experts: sigmoid scores, group-limited top-k steered by a bias, and
shared experts, as transformers' ``DeepseekV3MoE`` / ``DeepseekV3TopkRouter``.

Routing (float32 router logits): scores ``sigmoid(logits)``; the choice adds each expert's
``e_score_correction_bias`` (selection only: the gates are the scores, so no gradient reaches
the bias; the step moves it by the observed loads, :mod:`fiddlejax.parallel.balance`, at
``bias_update_speed`` per step). The ``E`` experts form ``n_group`` groups; a group's rank
is the sum of its two best biased scores, tokens choose among the experts of their
``topk_group`` best groups only, the top ``k`` of those. The gates are the chosen scores
(divided by their sum with ``norm_topk_prob``) times ``routed_scaling_factor``.
``n_shared_experts`` always-on experts, one SwiGLU ``n_shared_experts * intermediate_size``
wide, add to every token's output.

Dispatch, expert parallelism and the router tally are :class:`~.moe.MoE`'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fiddlejax.memory import names
from fiddlejax.parallel.balance import RouterBias
from fiddlejax.parallel.ops import Ops

from .common import param, project
from .moe import ACTIVATIONS, MoE, MoEConfig, MoEOutput


@dataclasses.dataclass(frozen=True)
class DeepseekMoEConfig(MoEConfig):
    """:class:`~.moe.MoEConfig` (``scoring="sigmoid"``) plus DeepSeek's routing and shared
    experts (transformers' names)."""

    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    bias_update_speed: float = 0.001

    def __post_init__(self):
        super().__post_init__()
        me, e, g = type(self).__name__, self.num_experts, self.n_group
        if self.scoring != "sigmoid":
            raise ValueError(f"{me}.scoring={self.scoring!r}: DeepSeek-V3 scores by sigmoid")
        for f in ("n_group", "topk_group"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{me}.{f}={v!r} must be a positive int")
        if e % g or e // g < 2:
            raise ValueError(f"{me}.num_experts={e} must split into n_group={g} groups of at "
                             "least 2 experts (a group ranks by its two best scores)")
        if self.topk_group > g:
            raise ValueError(f"{me}.topk_group={self.topk_group} exceeds n_group={g}")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ValueError(f"{me}.num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                             f"{self.topk_group * (e // g)} experts of topk_group="
                             f"{self.topk_group} groups; raise topk_group")
        n = self.n_shared_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{me}.n_shared_experts={n!r} must be an int >= 0")
        v = self.bias_update_speed
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{me}.bias_update_speed={v!r} must be a number >= 0 (0: the "
                             "router bias stays as loaded)")


def group_route(logits: jax.Array, bias: jax.Array, c: DeepseekMoEConfig
                ) -> tuple[jax.Array, jax.Array]:
    """``(gates, experts)`` ``[N, k]`` of float32 router ``logits [N, E]`` (module docstring)."""
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias).astype(jnp.float32)
    n, e, g = choice.shape[0], c.num_experts, c.n_group
    if g > 1:
        best = jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0].sum(-1)  # [N, G]
        groups = jax.lax.top_k(best, c.topk_group)[1]
        keep = jnp.any(groups[..., None] == jnp.arange(g), axis=-2)  # [N, G]
        choice = jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, c.num_experts_per_tok)[1]
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if c.norm_topk_prob:
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    return gates * c.routed_scaling_factor, experts.astype(jnp.int32)


class DeepseekMoE(MoE):
    """:class:`~.moe.MoE` routed as DeepSeek-V3, plus the shared experts (``w1``/``w3``/``w2``
    as a dense MLP's, split over ``tensor`` the same way)."""

    def __init__(self, config: DeepseekMoEConfig, *, rngs: nnx.Rngs,
                 out_std: float | None = None):
        super().__init__(config, rngs=rngs, out_std=out_std)
        c, normal = config, jax.nn.initializers.normal
        # e_score_correction_bias: moved after each step by the loads, never by the optimizer
        self.bias = RouterBias(jnp.zeros((c.num_experts,)), out_sharding=(None,),
                               eager_sharding=False, speed=float(c.bias_update_speed))
        if c.n_shared_experts:
            d, f = c.hidden_size, c.intermediate_size * c.n_shared_experts
            self.w1 = param(rngs, normal(0.02), (d, f), ("embed", "mlp"))
            self.w3 = param(rngs, normal(0.02), (d, f), ("embed", "mlp"))
            self.w2 = param(rngs, normal(out_std or 0.02), (f, d), ("mlp", "embed"))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        return (logits, *group_route(logits, self.bias[...], self.config))

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> MoEOutput:
        out = super().__call__(x, ops)
        if not self.config.n_shared_experts:
            return out
        act = ACTIVATIONS[self.config.hidden_act]
        gate = checkpoint_name(project(self, "w1", x, "...d,df->...f"), names.MLP_HIDDEN)
        up = checkpoint_name(project(self, "w3", x, "...d,df->...f"), names.MLP_HIDDEN)
        shared = project(self, "w2", act(gate) * up, "...f,fd->...d")
        return out._replace(output=out.output + shared.astype(out.output.dtype))
