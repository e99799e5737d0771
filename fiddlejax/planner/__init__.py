"""What-if prediction and layout search (Daydream's idea, PipeDream's optimizer).

    from fiddlejax import planner
    model = planner.gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    cluster = planner.cluster("h100", nodes=64)
    p = planner.predict(model, cluster, planner.Layout(tensor=8, pipe=8, data=8, ...))
    best = planner.search(model, cluster, global_batch=1536)[:5]

Pure Python except ``from_flax`` (which measures a Flax model with JAX).
"""

from fiddlejax.planner.cluster import ClusterSpec, GPUSpec, cluster
from fiddlejax.planner.experts import MoESpec, moe_llama
from fiddlejax.planner.families import deepseek_v3, gpt_oss, preset
from fiddlejax.planner.predict import Memory, Prediction, StepTime, memory, predict
from fiddlejax.planner.search import search
from fiddlejax.planner.space import Layout, validate
from fiddlejax.planner.workload import ModelSpec, from_flax, gpt, llama

__all__ = [
    "ClusterSpec", "GPUSpec", "Layout", "Memory", "MoESpec", "ModelSpec", "Prediction",
    "StepTime", "cluster", "deepseek_v3", "from_flax", "gpt", "gpt_oss", "llama", "memory",
    "moe_llama", "predict", "preset", "search", "validate",
]
