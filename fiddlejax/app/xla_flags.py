"""XLA flags from one place, the user's own ``XLA_FLAGS`` always winning: on a GPU what MaxText
and the JAX/NVIDIA GPU performance guides set for transformer training; on the CPU, where every
simulated device's memory is the host's, a schedule for memory.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so :func:`apply` must run before
anything touches a device (the job calls it first thing).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

# name -> value; each is a flag of the XLA that jaxlib 0.10 ships (tests/test_xla_flags.py
# starts XLA with all of them: an unknown flag would abort the process).
GPU_FLAGS: dict[str, str] = {
    # Schedule collectives to overlap with compute (the one flag NVIDIA's JAX images bake in).
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Combine small collectives into fewer, larger ones (MaxText's 1 GiB / 128 MiB class).
    "xla_gpu_all_reduce_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_all_gather_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(1 << 29),
    # FSDP: start the gathers of the next loop iteration (layer) in this one, and scatter the
    # last one's gradients while computing.
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}
# fp8 matmuls (Plan(matmul_dtype="fp8")): cuBLAS GEMMs, MaxText's choice. Measured on one H200
# (benchmarks/results/mfu.md): fp8 46.6% MFU with them vs 44.6% with XLA's Triton GEMMs, but
# bf16 39.7% vs 42.7% (the hand-written bf16 step 44.0% vs 46.2%), so bf16 keeps Triton's.
FP8_FLAGS: dict[str, str] = {"xla_gpu_enable_triton_gemm": "false"}
# The CPU's default scheduler orders a step for concurrency and holds more buffers at once:
# a zero=3 fine-tune of a 0.45 GB checkpoint on 8 simulated devices (benchmarks/
# hf_checkpoint_memory.py's job, remat full, bf16) compiles to 9.25x its bytes (10.02x with it:
# Trainer.memory()), at the same step time.
CPU_FLAGS: dict[str, str] = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def gpu_expected(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether JAX will start a GPU backend, judged without starting one: ``JAX_PLATFORMS``
    when set, else whether a CUDA or ROCm plugin is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return any(p in ("cuda", "gpu", "rocm") for p in platforms.split(","))
    return any(importlib.util.find_spec(name) is not None for name in
               ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm60_plugin",
                "jax_rocm7_plugin"))


def merged(user: str, recommended: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """``(XLA_FLAGS, added)``: the user's flags as given, then each recommended flag the user
    did not set (by name, whatever value they chose)."""
    given = {f.split("=", 1)[0].lstrip("-") for f in user.split() if f.startswith("--")}
    added = {k: v for k, v in recommended.items() if k not in given}
    flags = " ".join([user.strip(), *(f"--{k}={v}" for k, v in added.items())]).strip()
    return flags, added


def apply(gpu: bool | None = None, environ=os.environ, *, fp8: bool = False) -> dict[str, str]:
    """Set the recommended flags in ``environ["XLA_FLAGS"]`` (before JAX starts): the GPU's
    when the backend will be a GPU (with :data:`FP8_FLAGS` for fp8 matmuls), else the CPU's;
    returns the flags it added."""
    gpu = gpu_expected(environ) if gpu is None else gpu
    recommended = {**GPU_FLAGS, **(FP8_FLAGS if fp8 else {})} if gpu else CPU_FLAGS
    flags, added = merged(environ.get("XLA_FLAGS", ""), recommended)
    environ["XLA_FLAGS"] = flags
    return added


def describe(added: Mapping[str, str]) -> str:
    """One line for the job's log: what was set, and how to override it."""
    if not added:
        return ""
    gpu = any(k.startswith("xla_gpu") for k in added)
    return (f"XLA flags set for {'GPU' if gpu else 'CPU'} (override any in XLA_FLAGS): "
            + " ".join(f"--{k}={v}" for k, v in added.items()))
