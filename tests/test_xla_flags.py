"""The XLA flags: the GPU's only for a GPU backend, the CPU's memory schedule otherwise, the
user's own flags win, and every flag exists in the installed XLA (an unknown flag aborts the
process at backend start)."""

from __future__ import annotations

import subprocess
import sys

from fiddlejax.app import xla_flags


def test_gpu_flags_only_for_a_gpu_backend():
    env = {"JAX_PLATFORMS": "cpu"}
    assert xla_flags.apply(environ=env) == xla_flags.CPU_FLAGS
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert xla_flags.describe(xla_flags.CPU_FLAGS).startswith("XLA flags set for CPU")
    env = {"JAX_PLATFORMS": "cuda"}
    added = xla_flags.apply(environ=env)
    assert added == xla_flags.GPU_FLAGS
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"]
    assert "xla_gpu_enable_triton_gemm" not in added  # bf16: XLA's Triton GEMMs (faster, H200)
    env = {"JAX_PLATFORMS": "cuda"}
    assert xla_flags.apply(environ=env, fp8=True) == {**xla_flags.GPU_FLAGS,
                                                     **xla_flags.FP8_FLAGS}
    assert "--xla_gpu_enable_triton_gemm=false" in env["XLA_FLAGS"]  # fp8: cuBLAS
    assert xla_flags.gpu_expected({"JAX_PLATFORMS": "cuda,cpu"})
    assert "override" in xla_flags.describe(added) and xla_flags.describe({}) == ""


def test_users_own_flags_win():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --foo=1"}
    added = xla_flags.apply(environ=env, fp8=True)
    assert "xla_gpu_enable_triton_gemm" not in added
    flags = env["XLA_FLAGS"].split()
    assert flags[:2] == ["--xla_gpu_enable_triton_gemm=true", "--foo=1"]
    assert "--xla_gpu_enable_triton_gemm=false" not in flags
    assert len(flags) == 2 + len(added)


def test_every_flag_exists_in_the_installed_xla():
    flags, _ = xla_flags.merged("", {**xla_flags.GPU_FLAGS, **xla_flags.FP8_FLAGS,
                                     **xla_flags.CPU_FLAGS})
    code = "import jax; print(jax.numpy.ones(2).sum())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr[-2000:]
