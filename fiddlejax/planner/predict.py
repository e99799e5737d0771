"""Daydream-style what-if prediction: step time and memory per GPU of a layout, before running.

A :class:`Prediction` joins the two halves of the model: :mod:`fiddlejax.planner.timing`
(compute, tensor- and data-parallel communication, the schedule simulator's bubble) and
:mod:`fiddlejax.planner.footprint` (parameters, gradients, optimizer state, the activation
stash and the working set per GPU); their docstrings say what each counts. Their names are
importable from here too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fiddlejax.planner import attention
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.footprint import (
    VOCAB_PARALLEL_MIN,
    Memory,
    chunk_layers,
    held_microbatches,
    inbox_slots,
    memory,
    outer_params,
    stage_params,
    vocab_parallel,
)
from fiddlejax.planner.space import Layout, validate
from fiddlejax.planner.timing import (
    MAX_SIMULATED_ACTIONS,
    StepTime,
    allreduce_seconds,
    step_time,
    vocab_allreduces,
)
from fiddlejax.planner.workload import ModelSpec


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A layout's predicted step time, throughput and memory on a cluster."""

    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    time: StepTime
    memory: Memory
    bubble_fraction: float
    held: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.cluster.memory_budget

    @property
    def tokens_per_second(self) -> float:
        return self.layout.global_batch * self.model.seq_len / self.time.total

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model FLOPs (no recomputation) per second per GPU, in TFLOP/s."""
        flops = self.model.model_flops(self.layout.global_batch)
        return flops / self.time.total / self.layout.gpus / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        """Executed FLOPs (recomputation included) per second per GPU, in TFLOP/s."""
        flops = self.model.train_flops(self.layout.global_batch, self.layout.remat)
        return flops / self.time.total / self.layout.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_tflops_per_gpu * 1e12 / self.cluster.gpu.peak_flops

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name, "cluster": self.cluster.name,
            "attention": attention.kind(self.model, self.layout, self.cluster),
            "gpus": self.layout.gpus, "layout": self.layout.to_dict(),
            "step_time_s": self.time.total, "time": self.time.to_dict(),
            "bubble_fraction": self.bubble_fraction, "held_microbatches": self.held,
            "memory": self.memory.to_dict(),
            "memory_budget": self.cluster.memory_budget, "fits": self.fits,
            "tokens_per_s": self.tokens_per_second,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
        }


def predict(model: ModelSpec, cluster: ClusterSpec, layout: Layout,
            simulate: bool = True) -> Prediction:
    """Predict ``layout`` for ``model`` on ``cluster`` (validates first)."""
    validate(layout, model, cluster)
    time, bubble = step_time(model, cluster, layout, simulate)
    return Prediction(model=model, cluster=cluster, layout=layout, time=time,
                      memory=memory(model, layout, cluster), bubble_fraction=bubble,
                      held=held_microbatches(layout))


__all__ = [
    "MAX_SIMULATED_ACTIONS", "VOCAB_PARALLEL_MIN", "Memory", "Prediction", "StepTime",
    "allreduce_seconds", "chunk_layers", "held_microbatches", "inbox_slots", "memory",
    "outer_params", "predict", "stage_params", "step_time", "vocab_allreduces", "vocab_parallel",
]
