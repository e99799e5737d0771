"""FSDP's all-gathers in the compute dtype: bytes gathered per step and compiled memory.

With ``fj.Plan(zero=3, compute_dtype="bfloat16")`` the float32 master shards are cast to bf16
before they are all-gathered (as their 16-bit bits, ``uint16``, so that XLA's CPU sends 16 bits
too) on every path: the prefetching stack (``fsdp_prefetch=True``), each layer's own gathers
(``fsdp_prefetch=False``, a pipeline, data=1 sharded over context) and the embedding and head.
The gradients are still reduce-scattered in float32.

Written to ``benchmarks/results/fsdp_gather_dtype.md``: per compiled step of a Llama (8
simulated CPU devices, data=8, zero=3, bf16), the all-gathers' and reduce-scatters' result
bytes per step by element type (an op inside a layer loop counted once per iteration, from the
loop's known trip count) and ``memory_analysis``'s temp bytes, for prefetch off/on and remat
none/full; each beside the same step with ``ParamView.leaf`` as it was before
(:func:`gather_then_cast`: the float32 shards gathered, then cast).

    python benchmarks/fsdp_gather_dtype.py [--hidden 512 --layers 8 --shapes 256x16,32x8]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # before jax is imported: 8 simulated devices for the compile
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reporting  # noqa: E402
from fsdp_prefetch import MIB, _computations  # noqa: E402

_KINDS = ("all-gather", "reduce-scatter", "all-reduce")
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "u16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1,
         "u8": 1, "pred": 1}


def collective_bytes(hlo: str) -> Counter:
    """``{(kind, element type): result bytes per step}`` of a compiled module's all-gathers,
    reduce-scatters and all-reduces, each weighted by how often its computation runs (a while
    body by its ``known_trip_count``)."""
    comps = _computations(hlo)
    entry = re.search(r"ENTRY %([\w.\-]+)", hlo).group(1)
    runs: Counter = Counter()

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for _, op, line in comps.get(name, ()):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            for callee in re.findall(r"(?:calls|body|branch_computations=\{)=?%([\w.\-]+)",
                                     line):
                visit(callee, times * (int(trips.group(1)) if trips and op == "while" else 1))

    visit(entry, 1)
    out: Counter = Counter()
    for name, times in runs.items():
        for _, op, line in comps[name]:
            kind = op.removesuffix("-start")
            if kind not in _KINDS or op.endswith("-done"):
                continue
            result = line.split("=", 1)[1].split(op + "(", 1)[0]
            arrays = re.findall(r"(\w+)\[([\d,]*)\]", result)
            if op.endswith("-start"):  # (operands..., results...): the results
                arrays = arrays[len(arrays) // 2:]
            for ty, dims in arrays:
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                out[kind, ty] += times * n * _ITEM.get(ty, 4)
    return out


def gather_then_cast(self, x, dim, spec=None):
    """``fiddlejax.compute.ParamView.leaf`` before the gathers moved to the compute dtype: the
    float32 shard all-gathered, then cast (for comparison; the tests use it too)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from fiddlejax import compute

    if dim >= 0:
        spec = spec if spec is not None else P()
        stored = compute.add_data_axis(spec, dim, self.also) if self.also else None
        x = compute._per_device(lambda a: compute._gathered(a, dim, self.also), x, spec,
                                stored, self.mesh)
    if self.dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(self.dtype)
    return x


def main() -> int:
    from fiddlejax import compute

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="256x16,32x8",
                    help="sequence x batch per step, comma-separated (the second: activations "
                         "small beside the weights)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"
                                         / "fsdp_gather_dtype.md"))
    a = ap.parse_args()
    out = ["# FSDP: all-gathers in the compute dtype", "",
           f"Reproduce: `python benchmarks/fsdp_gather_dtype.py --hidden {a.hidden} --layers "
           f"{a.layers} --shapes {a.shapes}`. One training step compiled on 8 simulated CPU "
           f"devices: Llama hidden {a.hidden}, {a.layers} layers, MLP {4 * a.hidden}, "
           "vocabulary 1024; data=8, zero=3, bf16 compute, float32 master weights. Per device "
           "and step: the collectives' result bytes by element type (AG all-gather, RS "
           "reduce-scatter, AR all-reduce; a gather's result is the whole weight, a scatter's "
           "the shard), `memory_analysis` temp bytes. *leaf*: `ParamView.leaf` (the layers' "
           "gathers with prefetch off, the embedding's and head's always) before (float32 "
           "gathered, cast after) and now."]
    leaf = compute.ParamView.leaf
    for shape in a.shapes.split(","):
        seq, batch = map(int, shape.split("x"))
        out += ["", f"Sequence {seq}, batch {batch}:", "",
                "| prefetch | remat | leaf | AG u16/bf16 | AG f32 | RS f32 | AR f32 | temp |",
                "|---|---|---|---|---|---|---|---|"]
        table(out, a.hidden, a.layers, seq, batch, leaf)
    reporting.write(Path(a.out), "\n".join(out) + "\n")
    return 0


def table(out: list, hidden: int, layers: int, seq: int, batch: int, leaf) -> None:
    from fsdp_prefetch import compiled

    from fiddlejax import compute

    for prefetch in (False, True):
        for remat in ("none", "full"):
            for name, how in (("gather, cast (before)", gather_then_cast),
                              ("cast, gather", leaf)):
                compute.ParamView.leaf = how
                try:
                    mem, hlo = compiled(hidden, layers, seq, batch, prefetch, "bfloat16",
                                        remat)
                finally:
                    compute.ParamView.leaf = leaf
                b = collective_bytes(hlo)
                ag16 = b["all-gather", "u16"] + b["all-gather", "bf16"]
                out.append(f"| {'on' if prefetch else 'off'} | {remat} | {name} | "
                           f"{ag16 / MIB:.2f} MiB | {b['all-gather', 'f32'] / MIB:.2f} MiB | "
                           f"{b['reduce-scatter', 'f32'] / MIB:.2f} MiB | "
                           f"{b['all-reduce', 'f32'] / MIB:.2f} MiB | "
                           f"{mem['temp'] / MIB:.2f} MiB |")
                print(out[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
