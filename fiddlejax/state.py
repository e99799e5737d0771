"""``TrainState``: everything one training step reads and writes, as one pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates: the step counter, internal-layout parameters, optimizer state.

    ``residual`` is the top-k error-feedback memory (``Plan(grad_allreduce="topk")``): per data
    replica, what its gradient exchange has not sent yet, leaves ``[data, *param.shape]`` sharded
    over ``data``. ``None`` (no leaves) for every other plan.

    ``prev_params`` is PipeDream-2BW's older weight version W(t-1) (``Plan(schedule="2bw")``),
    on which the next step's gradients are computed; ``None`` for every other plan.
    """

    step: jax.Array
    params: nnx.State
    opt_state: Any
    residual: Any = None
    prev_params: Any = None

    def advanced(self, **changes) -> TrainState:
        """The next step's state: the counter + 1 (or ``step=``) and the fields ``changes``."""
        return dataclasses.replace(self, **{"step": self.step + 1, **changes})


def in_param_dtypes(grads: Any, params: Any) -> Any:
    """Each gradient in its parameter's dtype, as ``jax.grad`` gives it. The runtime accumulates
    and reduces gradients in float32 whatever the parameters' dtype; 16-bit parameters get
    theirs rounded once, before the optimizer, so its state (AdamW's moments follow the
    parameters) keeps the dtype it was made with."""
    return jax.tree.map(lambda g, p: g if g.dtype == p.dtype else g.astype(p.dtype),
                        grads, params)
