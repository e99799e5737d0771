"""Qwen3-32B and Gemma-2-27B on 16 x 80 GB: bf16, zero=3, compile only.

As ``benchmarks/scale.py`` does for Llama 3: the planner searches the FSDP layouts
(``zero=3``, ``precision="bf16-mixed"``, full remat, 1F1B when pipelined) of two 8-GPU H100
nodes and picks the fastest that fits with ``data`` > 1 (its faster d=1 picks hold a whole
replica per pipeline, where zero=3 shards nothing). That layout is built as a real ``fj.Plan``
around the family's model made from its published ``config.json`` shape
(``fiddlejax.models.decoder.Qwen3`` / ``Gemma2`` with ``nnx.eval_shape``: no weights exist),
compiled on 16 simulated CPU devices, and ``trainer.memory(global_batch)`` gives the
per-device bytes of one step, printed beside the planner's figure (the bar: within 10%). The
planner reads the same config.json (``planner.hf_config``): its analytic Llama with
``head_dim``, Gemma 2's soft-capped attention as XLA's with the cap's float32 copies
(``planner.attention.capped``); Gemma 2's extra norms are not counted. Writes
``benchmarks/results/scale_families.md``.

    python benchmarks/scale_families.py [--layers N] [--seq 4096] [--only qwen3-32b|gemma2-27b]
                                        [--pipelined]

``--layers N`` compiles N and 2N layers and extrapolates per layer, as scale.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=16"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402
from scale import markdown  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import planner  # noqa: E402
from fiddlejax.models.decoder import FAMILIES  # noqa: E402

# The published config.json shapes (Qwen/Qwen3-32B, google/gemma-2-27b).
CONFIGS = {
    "qwen3-32b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
                  "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "gemma2-27b": {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 4608,
                   "intermediate_size": 36864, "num_hidden_layers": 46,
                   "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                   "max_position_embeddings": 8192, "query_pre_attn_scalar": 144,
                   "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0},
}
GPUS, GLOBAL_BATCH = 16, 64


def spec(name: str, seq: int, layers: int | None = None) -> planner.ModelSpec:
    from fiddlejax.planner import hf_config

    c = {**CONFIGS[name], **({"num_hidden_layers": layers} if layers else {})}
    return hf_config.spec(c, seq, name=name)


def pick_layout(model: planner.ModelSpec, cluster: planner.ClusterSpec,
                global_batch: int, pipelined: bool = False) -> planner.Prediction:
    """The planner's fastest bf16 layout that fits and shards over ``data`` with zero=3
    (its faster d=1 picks hold whole replicas per pipeline, where zero=3 is moot); with
    ``pipelined`` the fastest such layout with pipe > 1 (scale.py's rule)."""
    ranked = planner.search(model, cluster, global_batch, zero=(3,), precision="bf16-mixed",
                            remats=("full",), schedules=("1f1b",), microbatch_sizes=(1, 2, 4),
                            fsdp_gathers=("layer",), attention="xla")  # XLA's CPU compile
    sharded = [pr for pr in ranked if pr.layout.zero == 3 and pr.layout.data > 1
               and (pr.layout.pipe > 1 or not pipelined)]
    if not sharded:
        raise ValueError(f"no zero=3 layout of {model.name} fits {cluster.describe()}")
    return sharded[0]


def compiled_memory(name: str, layout: planner.Layout, seq: int, layers: int) -> dict:
    cls = FAMILIES[CONFIGS[name]["model_type"]]
    config = cls.config_from_hf({**CONFIGS[name], "num_hidden_layers": layers}, seq_len=seq)
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    mesh = fj.make_mesh(data=layout.data, pipe=layout.pipe, tensor=layout.tensor,
                        devices=jax.devices()[:layout.gpus])
    plan = fj.Plan(mesh=mesh, schedule=layout.kind, microbatches=layout.microbatches,
                   virtual_stages=layout.virtual_stages, remat=layout.remat, zero=layout.zero,
                   fsdp_gather=layout.fsdp_gather, compute_dtype="bfloat16")
    return fj.parallelize(model, optax.adamw(1e-4), plan).memory(layout.global_batch)


def measure(name: str, seq: int, layers: int | None, pipelined: bool = False) -> dict:
    cluster = planner.cluster("h100", nodes=GPUS // 8)
    pr = pick_layout(spec(name, seq), cluster, GLOBAL_BATCH, pipelined)
    lo, total = pr.layout, CONFIGS[name]["num_hidden_layers"]
    t0 = time.perf_counter()
    if layers is None or layers >= total:
        compiled, how = float(compiled_memory(name, lo, seq, total)["peak_bytes"]), "full compile"
    else:
        a = compiled_memory(name, lo, seq, layers)["peak_bytes"]
        b = compiled_memory(name, lo, seq, 2 * layers)["peak_bytes"]
        compiled = b + (total - 2 * layers) * (b - a) / layers
        how = f"{layers} and {2 * layers} layers, extrapolated"
    predicted = planner.memory(pr.model, lo).total
    return {"model": name, "params": pr.model.params, "gpus": lo.gpus, "layout": lo.short(),
            "microbatches": lo.microbatches, "global_batch": lo.global_batch, "seq": seq,
            "predicted": predicted, "compiled": compiled, "error": predicted / compiled - 1,
            "hbm": cluster.gpu.memory_bytes, "how": how, "compile_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, help="compile N and 2N layers and extrapolate")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--only", choices=sorted(CONFIGS))
    ap.add_argument("--pipelined", action="store_true",
                    help="also the fastest pipelined zero=3 pick (pipe > 1) of each model")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "scale_families.md"))
    a = ap.parse_args()
    rows = []
    for name in CONFIGS:
        if a.only and name != a.only:
            continue
        for piped in (False, True) if a.pipelined else (False,):
            rows.append(measure(name, a.seq, a.layers, piped))
            print(markdown(rows[-1:]).splitlines()[-1], f"({rows[-1]['compile_s']:.0f} s)",
                  flush=True)
    cmd = "python benchmarks/scale_families.py" + "".join(
        f" --{k} {v}" for k, v in (("layers", a.layers), ("only", a.only)) if v) + (
        " --pipelined" if a.pipelined else "")
    reporting.write(Path(a.out),
        "# Scale: Qwen3-32B and Gemma-2-27B in bf16 with zero=3 on 16 x 80 GB, compile only\n\n"
        f"`{cmd}`: the planner's fastest zero=3 bf16 layout (data > 1) of two 8 x H100 nodes "
        "(90% of 80 GiB usable), compiled as one training step of the family's model "
        "(`nnx.eval_shape`, real shapes) on 16 simulated CPU devices; "
        f"global batch {GLOBAL_BATCH} x {a.seq} tokens. Error = predicted / compiled - 1.\n\n"
        + markdown(rows))
    return 0 if all(abs(r["error"]) < 0.10 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
