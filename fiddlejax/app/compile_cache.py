"""XLA's compiled programs kept on disk (JAX's persistent compilation cache), so that the next
start of the same job, a resume after preemption, or an ``eval`` of its run skips compiling.

Compiling is most of a job's fixed start: on a tiny model on the CPU, a second start with the
cache spends about half the CPU time of the first (``docs/performance.md``). Every program is
kept, however quick to compile (JAX's default keeps only those over a second; the many small
ones of a model's initialisation add up); the default directory is bounded (least recently
used entries go first, under a file lock). The user's own JAX settings
(``JAX_COMPILATION_CACHE_DIR`` and the other ``JAX_*`` variables) win.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: when set, auto uses it
DEFAULT = Path("~/.cache/fiddlejax/xla")
MAX_BYTES = 4 << 30  # LRU bound of the default directory


def directory(setting: str | None) -> Path | None:
    """The directory ``run.compile_cache`` names: auto is ``$JAX_COMPILATION_CACHE_DIR``, else
    ``~/.cache/fiddlejax/xla``; null: none (JAX's own settings alone apply)."""
    if setting is None:
        return None
    if setting == "auto":
        return Path(os.environ.get(ENV) or DEFAULT).expanduser()
    return Path(setting).expanduser()


def use(setting: str | None) -> Path | None:
    """Turn the cache on for this process before its first compile; returns the directory.
    (JAX opens its cache once per process: the first directory of a process stays.)"""
    import jax

    path = directory(setting)
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    for name, value in (("min_compile_time_secs", 0.0), ("min_entry_size_bytes", 0)):
        if f"JAX_PERSISTENT_CACHE_{name.upper()}" not in os.environ:
            jax.config.update(f"jax_persistent_cache_{name}", value)
    if path == DEFAULT.expanduser() and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        # our own directory only: JAX's eviction reads an access-time file beside every entry,
        # which a directory written without eviction (another program's) does not have
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
