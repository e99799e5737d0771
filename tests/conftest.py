"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

One persistent XLA compilation cache per test session, shared by the xdist workers and every
process the tests start (CLI runs, resumed runs, multi-process jobs all compile the same programs):
each program is still compiled once per session, never reused from an earlier one.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# LLVM at -O0: a third less compile time, which dominates this suite. XLA's HLO passes, buffer
# assignment (memory_analysis) and cost_analysis are unchanged; every comparison in the tests is
# between programs compiled the same way. Subprocesses started by the tests inherit it.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's older elemental emitters, not the MLIR fusion emitters: a step compiles 2-3x faster
# (a tiny Llama's data=8 step 19.6 s -> 6.0 s), and memory_analysis, cost_analysis and losses
# agree within 0.04% (tiny Llama on data=8, 1F1B, zero=3). Probed once by the controller (the
# workers and subprocesses inherit XLA_FLAGS): an XLA that no longer knows the flag would abort.
_FAST = "--xla_cpu_use_fusion_emitters=false"
if ("xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
        and "PYTEST_XDIST_WORKER" not in os.environ
        and subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env={**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {_FAST}"},
                           capture_output=True).returncode == 0):
    os.environ["XLA_FLAGS"] += f" {_FAST}"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller; workers inherit it
    _cache = tempfile.mkdtemp(prefix="fiddlejax-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
if "FIDDLEJAX_DATA_CACHE" not in os.environ:  # prepared corpora: one store per session
    _data = tempfile.mkdtemp(prefix="fiddlejax-tests-data-cache-")
    os.environ["FIDDLEJAX_DATA_CACHE"] = _data
    atexit.register(shutil.rmtree, _data, ignore_errors=True)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
