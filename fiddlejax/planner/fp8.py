"""fp8 matmuls in the planner (``Plan(matmul_dtype="fp8")``, ``fiddlejax/compute/fp8.py``): which of
a layer's FLOPs and bytes change.

The runtime converts a layer's dense matmuls (a weight times an activation) to float8 with
per-tensor current scaling; attention's activation x activation dots, a MoE router, dropless
experts, the embedding and the head stay bf16. The planner prices the converted FLOPs at the
GPU's dense fp8 peak (``GPUSpec.fp8_flops``) and their quantization as elementwise HBM
traffic (``timing.fp8_layer``), and counts one layer's fp8 copies in the working set
(``footprint.fp8_copies``). A model says what is dense with :class:`DenseMatmuls`
(``ModelSpec.dense``).
"""

from __future__ import annotations

import dataclasses

QUANT_BYTES = 5  # per element quantized: read bf16 for the absmax, read it again to scale
# and round, write the fp8 copy (2 + 2 + 1)


@dataclasses.dataclass(frozen=True)
class DenseMatmuls:
    """One layer's dense matmuls (a weight times an activation): what ``matmul_dtype="fp8"``
    converts (``fiddlejax.compute.fp8``), per sample unless noted.

    - ``flops``: their forward FLOPs (attention's activation x activation dots are not here).
    - ``weights``: their weight elements per layer (split over ``tensor``), each quantized once
      per microbatch.
    - ``act``: (split over tensor, whole) activation elements quantized in the forward: each
      distinct input once (q, k and v read the same normed input; XLA merges the identical
      per-tensor scalings of one tensor).
    - ``grad``: (split, whole) output-gradient elements quantized to e5m2 in the backward (one
      per dot; the forward's fp8 weight and activation are reused).
    """

    flops: float
    weights: float
    act: tuple[float, float]
    grad: tuple[float, float]
    expert_weights: float = 0.0  # an MoE layer's experts in fp8 (split over expert x tensor)
