"""Collectives: all-reduce schedules over JAX collectives, topologies, a cost model, Blink-style
packed trees and top-k compression.

    y = fj.collectives.allreduce(x, "data", algorithm="ring")      # inside jax.shard_map
    g = fj.collectives.allreduce_tree(grads, "data", algorithm="auto", bucket_bytes=4 << 20)
    t = fj.collectives.predict("packed-trees", fj.collectives.dgx1_v100_fragment(), 2**30)
"""

from fiddlejax.collectives.algorithms import (
    ALGORITHMS,
    DEFAULT_BUCKET_BYTES,
    all_gather,
    allreduce,
    allreduce_tree,
    broadcast,
    bucket_plan,
    choose_algorithm,
    mark_invariant,
    reduce_scatter,
)
from fiddlejax.collectives.compression import (
    TopKState,
    dense_allreduce_bytes,
    sparse_allreduce,
    topk_allreduce,
    topk_bytes,
    topk_compress,
    topk_error_feedback,
)
from fiddlejax.collectives.cost import (
    bytes_sent_per_device,
    choose,
    hlo_collectives,
    predict,
    predict_all,
    schedule_time,
)
from fiddlejax.collectives.topology import (
    PRESETS,
    Link,
    Topology,
    dgx1_v100,
    dgx1_v100_fragment,
    dgx_h100,
    multi_node,
    preset,
    subset,
    switch,
)
from fiddlejax.collectives.trees import (
    Packing,
    allreduce_bound,
    binomial_tree,
    broadcast_bound,
    pack_trees,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BUCKET_BYTES",
    "PRESETS",
    "Link",
    "Packing",
    "TopKState",
    "Topology",
    "all_gather",
    "allreduce",
    "allreduce_bound",
    "allreduce_tree",
    "binomial_tree",
    "broadcast",
    "broadcast_bound",
    "bucket_plan",
    "bytes_sent_per_device",
    "choose",
    "choose_algorithm",
    "dense_allreduce_bytes",
    "dgx1_v100",
    "dgx1_v100_fragment",
    "dgx_h100",
    "hlo_collectives",
    "mark_invariant",
    "multi_node",
    "pack_trees",
    "predict",
    "predict_all",
    "preset",
    "reduce_scatter",
    "schedule_time",
    "sparse_allreduce",
    "subset",
    "switch",
    "topk_allreduce",
    "topk_bytes",
    "topk_compress",
    "topk_error_feedback",
]
