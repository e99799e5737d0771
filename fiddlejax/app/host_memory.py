"""The host's memory between a job's phases: what the C allocator keeps, given back.

glibc's malloc keeps freed memory for reuse, and raises its mapping threshold (up to 32 MB) each
time a large block is freed, after which blocks of a few MB (a save's snapshot of each array,
the compiler's work) come from the heap and stay there once freed. Measured on a 0.45 GB
checkpoint's fine-tune (benchmarks/hf_checkpoint_memory.py's job, its RSS): compiling the step
leaves the process 0.90x the checkpoint's bytes larger (0.16x after ``malloc_trim``), and a
save's snapshot grew it by 3.9x under a 0.2 GB bound. The step's own buffers come from fresh
mappings and cannot reuse that memory. Linux (glibc) only; elsewhere both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAPPED_FROM = 1 << 20  # blocks of 1 MB or more: their own mapping, unmapped when freed


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to ask
        return None


def map_large_blocks() -> bool:
    """Blocks of :data:`MAPPED_FROM` bytes or more get their own mapping from now on, returned
    to the system when freed (a fixed threshold: glibc stops raising it); True when set."""
    libc = _libc()
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)) if libc is not None else False


def release() -> bool:
    """Return the allocator's free memory to the system; True when it did."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
