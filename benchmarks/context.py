"""Context parallelism (fiddlejax/parallel/context.py): what splitting the sequence saves, and
which attention kernel to use where.

1. Memory, compile only (an abstract Llama, nothing allocated): the compiled per-device temp
   bytes of one training step at seq_len 8192, context=4 (ring and all-gathered K/V) against
   context=1 on one device (XLA's attention). Goal: <= 0.35x.
2. The two kernels side by side at context=4 over sequence lengths: compiled temp memory, and
   step time as a ratio (ring / all-gather, median of alternating steps on 4 simulated CPU
   devices; only the ratio means anything on a shared CPU).
3. The causal balance: the n x n attention blocks each shard computes in the ring, with the
   load-balanced layout (shard i holds chunks i and 2C-1-i) against a contiguous split
   (shard i holds chunk i): counted from the masks, as the kernel does.
5. Short sequences: data=2 x context=4 against data=8 at the same global batch (the same
   tokens per device): compiled peak and temp bytes per device, the step time as a ratio, and
   the largest ``context`` among the planner's candidates at that length (its search splits
   sequences only from ``search.LONG`` tokens).
4. Sequence parallelism on ``tensor`` (``Plan(sequence_parallel=True)``): the temp bytes per
   layer (the slope from 4 to 8 layers) at tensor=4, seq_len 1024: under ``remat="full"`` a
   layer keeps only its input, the replicated residual stream that SP splits over tensor.

    python benchmarks/context.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def llama(seq: int, abstract: bool = True):
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      seq_len=seq, max_position_embeddings=max(seq, 2048))
    make = lambda: Llama(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.eval_shape(make) if abstract else make()


def trainer(model, c: int, kernel: str = "auto"):
    mesh = fj.make_mesh(data=1, context=c, devices=jax.devices()[:c])
    return fj.parallelize(model, optax.sgd(1e-3), fj.Plan(mesh=mesh, context_kernel=kernel))


def temp_mib(seq: int, c: int, kernel: str = "auto") -> float:
    return trainer(llama(seq), c, kernel).memory(batch_size=1)["temp_bytes"] / MIB


def step_time_ratio(a, b, batch: dict, repeats: int) -> float:
    """Median step time of trainer ``a`` over trainer ``b`` (alternating steps, each compiled
    and run once first)."""
    runs = []
    for t in (a, b):
        state, sb = t.init(), t.shard_batch(batch)
        step = jax.jit(lambda s, x, t=t: t.loss_and_grads(s, x))
        jax.block_until_ready(step(state, sb))
        runs.append((step, state, sb))
    times = [[], []]
    for _ in range(repeats):
        for k, (step, state, sb) in enumerate(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, sb))
            times[k].append(time.perf_counter() - t0)
    return statistics.median(times[0]) / statistics.median(times[1])


def time_ratio(seq: int, c: int, repeats: int) -> float:
    """Median step time of the ring over the all-gather (alternating steps)."""
    model = llama(seq, abstract=False)
    batch = {"tokens": np.random.default_rng(0).integers(0, 256, (1, seq + 1)).astype(np.int32)}
    return step_time_ratio(trainer(model, c, "ring"), trainer(model, c, "allgather"), batch,
                           repeats)


def sp_slope(sp: bool, remat: str) -> float:
    """MiB of temp memory per layer (8 layers minus 4, over 4) at tensor=4."""
    def temp(layers):
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=4, seq_len=1024)
        m = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
        plan = fj.Plan(mesh=fj.make_mesh(data=1, tensor=4, devices=jax.devices()[:4]),
                       remat=remat, sequence_parallel=sp)
        return fj.parallelize(m, optax.sgd(1e-3), plan).memory(batch_size=1)["temp_bytes"]
    return (temp(8) - temp(4)) / 4 / MIB


def short_step(seq: int, data: int, c: int, abstract: bool = True):
    """A trainer on data x context (8 devices), AdamW, the batch of 8 sequences."""
    plan = fj.Plan(mesh=fj.make_mesh(data=data, context=c))
    return fj.parallelize(llama(seq, abstract), optax.adamw(1e-3), plan)


def short_time_ratio(seq: int, repeats: int) -> float:
    """Median step time of data=2 x context=4 over data=8 (alternating steps)."""
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (8, seq + 1)).astype(np.int32)}
    return step_time_ratio(short_step(seq, 2, 4, abstract=False),
                           short_step(seq, 8, 1, abstract=False), batch, repeats)


def planner_context(seq: int) -> int:
    """The largest context among the planner's candidate layouts for this Llama on 8 GPUs."""
    from fiddlejax.planner import cluster
    from fiddlejax.planner import llama as spec
    from fiddlejax.planner.search import candidates
    model = spec(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, seq=seq, vocab=256)
    return max(lay.context for lay in candidates(model, cluster("h100"), 8))


def short_rows(quick: bool) -> list[str]:
    lines = ["", "## Short sequences: data=2 x context=4 against data=8 (same tokens per device)",
             "", "AdamW, batch 8, the default plan (kernel `auto`); per-device MiB, compile only.",
             "", "| seq_len | data=8 peak | context=4 peak | ratio | data=8 temp | context=4 temp "
             "| step time ratio | planner's largest context |", "|---|---|---|---|---|---|---|---|"]
    for seq in (256, 512, 1024):
        one, four = short_step(seq, 8, 1).memory(8), short_step(seq, 2, 4).memory(8)
        ratio = short_time_ratio(seq, 3 if quick else 7) if seq == 256 else float("nan")
        shown = "not timed" if np.isnan(ratio) else f"{ratio:.2f}"
        lines.append(f"| {seq} | {one['peak_bytes'] / MIB:.2f} | {four['peak_bytes'] / MIB:.2f} "
                     f"| {four['peak_bytes'] / one['peak_bytes']:.3f}x "
                     f"| {one['temp_bytes'] / MIB:.2f} | {four['temp_bytes'] / MIB:.2f} "
                     f"| {shown} | {planner_context(seq)} |")
    return lines


def blocks(c: int, balanced: bool) -> list[int]:
    """Visible n x n blocks (n = T / 2C) each shard's ring computes, from chunk order alone."""
    held = [[i, 2 * c - 1 - i] if balanced else [2 * i, 2 * i + 1] for i in range(c)]
    out = []
    for i in range(c):
        count = 0
        for step in range(c):
            j = (i - step) % c
            count += sum(q >= k for q in held[i] for k in held[j])
        out.append(count)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    c = 4
    base = temp_mib(8192, 1)
    ring, gathered = temp_mib(8192, c, "ring"), temp_mib(8192, c, "allgather")
    lines = [
        "# Context parallelism: memory, kernels and balance (CPU, simulated devices)", "",
        "Llama, 2 layers, hidden 256, 4 query heads / 2 KV heads (head_dim 64), vocab 256, "
        "batch 1, float32, no remat; compiled per-device temp bytes of one step "
        "(`Trainer.memory`, compile only, abstract model).", "",
        "## seq_len 8192: context=4 against context=1", "",
        "| layout | temp MiB | vs context=1 |", "|---|---|---|",
        f"| context=1 (one device, XLA attention) | {base:.0f} | 1.00x |",
        f"| context=4, ring | {ring:.0f} | {ring / base:.3f}x |",
        f"| context=4, all-gathered K/V | {gathered:.0f} | {gathered / base:.3f}x |", "",
        "## The two kernels at context=4", "",
        "| seq_len | tokens per shard | ring temp MiB | all-gather temp MiB | ring / all-gather "
        "step time |", "|---|---|---|---|---|"]
    seqs = (512, 1024, 2048) if args.quick else (512, 1024, 2048, 4096)
    for seq in seqs:
        r, g = temp_mib(seq, c, "ring"), temp_mib(seq, c, "allgather")
        ratio = time_ratio(seq, c, 3 if args.quick else 7) if seq <= 2048 else float("nan")
        shown = "not timed" if np.isnan(ratio) else f"{ratio:.2f}"
        lines.append(f"| {seq} | {seq // c} | {r:.0f} | {g:.0f} | {shown} |")
    lines += ["", "## Causal balance of the ring (visible n x n blocks per shard, n = T / 2C)", "",
              "| context | balanced (chunks i, 2C-1-i) | spread | contiguous (chunks 2i, 2i+1) "
              "| spread |", "|---|---|---|---|---|"]
    for cc in (2, 4, 8):
        bal, con = blocks(cc, True), blocks(cc, False)
        spread = lambda x: (max(x) - min(x)) / max(x)  # noqa: E731
        lines.append(f"| {cc} | {bal} | {spread(bal):.0%} | {con} | {spread(con):.0%} |")
    lines += ["", "## Sequence parallelism on tensor=4 (seq_len 1024, hidden 256, float32)", "",
              "A layer's input, replicated over tensor without SP, is 1 x 1024 x 256 x 4 B = "
              "1 MiB.", "",
              "| remat | temp MiB per layer, SP off | SP on | removed |", "|---|---|---|---|"]
    for remat in ("full", "none"):
        off, on = sp_slope(False, remat), sp_slope(True, remat)
        lines.append(f"| {remat} | {off:.3f} | {on:.3f} | {off - on:.3f} |")
    lines += short_rows(args.quick)
    out = ROOT / "benchmarks" / "results" / "context.md"
    reporting.write(out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
