"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

One persistent XLA compilation cache per test session, shared by the xdist workers and every
process the tests start (CLI runs, resumed runs, multi-process jobs all compile the same programs):
each program is still compiled once per session, never reused from an earlier one.
"""

import atexit
import os
import shutil
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
