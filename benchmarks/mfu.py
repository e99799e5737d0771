"""MFU of a ~1B Llama in bf16: fiddlejax's step against a hand-written one, then per layout.

1. One device: fiddlejax's step (``Plan(compute_dtype="bfloat16")``, float32 masters, AdamW)
   against a plain ``jax.jit`` of ``value_and_grad`` + the same optax update on the same model,
   timed alternately in one run; the ratio is fiddlejax's overhead (goal <= 1.05).
   The same device then runs fiddlejax's step with fp8 matmuls (``Plan(matmul_dtype="fp8")``),
   so the one-device table shows MFU for the hand-written step, fiddlejax bf16 and fiddlejax fp8.
2. Every layout that fits one 8-device node (when 8 devices are there): data, FSDP (zero=3),
   tensor x data, and pipe x data with 1f1b, interleaved 1f1b and zb-v.

Model FLOPs are the job's formula (6 N per token for the matmul parameters + 12 L T d for
attention scores, ``fiddlejax.models`` ``flops_per_step``);
   MFU = model FLOP/s / (devices x the device's dense bf16 peak).

Writes a Markdown table (default ``benchmarks/results/mfu.md``) naming the device. On a CPU
``--smoke`` runs the same code at a tiny shape on 8 simulated devices (CI runs it); CPU times
say nothing about a GPU, and MFU is not shown for a device whose peak is unknown.

    python benchmarks/mfu.py                 # on a GPU machine
    python benchmarks/mfu.py --smoke --out /tmp/mfu.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # 8 simulated CPU devices, before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
ADDED: dict = {}
if "--smoke" not in sys.argv and "--no-xla-flags" not in sys.argv:
    from fiddlejax.app import xla_flags  # fiddlejax's GPU flags, as the job sets them for bf16

    ADDED = xla_flags.apply()
    print(xla_flags.describe(ADDED), flush=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import models  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402

# Llama 3.2 1B's shapes (1.24B parameters, tied embeddings), sequence 2048.
GPU_CONFIG = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, max_position_embeddings=2048,
                         tie_word_embeddings=True, seq_len=2048)
SMOKE_CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=32, tie_word_embeddings=True, seq_len=32)
# Dense bf16 peak FLOP/s per device (the vendors' datasheets, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}

# (name, Plan keywords) for one 8-device node; data fills what the others leave.
LAYOUTS = [
    ("data=8", dict(data=8)),
    ("fsdp data=8 (zero=3)", dict(data=8, zero=3)),
    ("tensor=2 data=4", dict(data=4, tensor=2)),
    ("pipe=2 data=4 1f1b", dict(data=4, pipe=2, schedule="1f1b", microbatches=4)),
    ("pipe=2 data=4 interleaved", dict(data=4, pipe=2, schedule="interleaved-1f1b",
                                       microbatches=4, virtual_stages=2)),
    ("pipe=2 data=4 zb-v", dict(data=4, pipe=2, schedule="zb-v", microbatches=4,
                                virtual_stages=2)),
]


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_BF16.items() if k in kind), None)


def timed(fn, state, batch, steps: int):
    """Per-step seconds of ``fn`` (already compiled and warm), each blocked on its result."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = fn(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, times


def hand_written(model, optimizer, device):
    """A plain jitted step: bf16 compute on float32 masters, the model's own loss."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, batch):
        low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        m = nnx.merge(graphdef, low, rest)
        return fj.mean_loss(m.loss(m(batch["tokens"][:, :-1]).astype(jnp.float32), batch))

    def step(state, batch):
        p, o = state
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), {"loss": loss}

    params = jax.device_put(params, device)
    return jax.jit(step, donate_argnums=0), (params, optimizer.init(params))


def one_device_ratio(config, batch_size: int, rounds: int, steps: int) -> dict:
    device = jax.devices()[0]
    model = Llama(config, rngs=nnx.Rngs(0))
    optimizer = optax.adamw(1e-4)
    batch = {"tokens": np.random.default_rng(0).integers(
        0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)}
    plan = fj.Plan(mesh=fj.make_mesh(data=1, pipe=1, tensor=1, devices=[device]),
                   compute_dtype="bfloat16")
    trainer = fj.parallelize(model, optimizer, plan)
    ours, ours_state = trainer.step_function(donate=True), trainer.init()
    placed = trainer.shard_batch(batch)
    theirs, theirs_state = hand_written(model, optimizer, device)
    plain = jax.device_put(batch, device)
    ours_state, _ = timed(ours, ours_state, placed, 2)  # compile and warm up
    theirs_state, _ = timed(theirs, theirs_state, plain, 2)
    ratios, ours_t, theirs_t = [], [], []
    for _ in range(rounds):
        ours_state, a = timed(ours, ours_state, placed, steps)
        theirs_state, b = timed(theirs, theirs_state, plain, steps)
        ratios.append(statistics.median(a) / statistics.median(b))
        ours_t += a
        theirs_t += b
    return {"ratio": statistics.median(ratios), "ours_s": statistics.median(ours_t),
            "theirs_s": statistics.median(theirs_t), "batch_size": batch_size,
            "seq_len": config.seq_len}


def layout_row(config, name: str, kw: dict, batch_size: int, steps: int, peak) -> dict:
    model = Llama(config, rngs=nnx.Rngs(0))
    devices = jax.devices()[:kw["data"] * kw.get("pipe", 1) * kw.get("tensor", 1)]
    mesh = fj.make_mesh(data=kw.pop("data"), pipe=kw.pop("pipe", 1), tensor=kw.pop("tensor", 1),
                        devices=devices)
    plan = fj.Plan(mesh=mesh, compute_dtype="bfloat16", **kw)
    trainer = fj.parallelize(model, optax.adamw(1e-4), plan)
    batch = trainer.shard_batch({"tokens": np.random.default_rng(0).integers(
        0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)})
    step, state = trainer.step_function(donate=True), trainer.init()
    state, _ = timed(step, state, batch, 2)
    _, times = timed(step, state, batch, steps)
    seconds = statistics.median(times)
    flops = models.get("llama").flops_per_step(model, batch_size)
    n = mesh.devices.size
    return row(name, seconds, flops, batch_size * config.seq_len, n, peak)


def row(name: str, seconds: float, flops: float, tokens: int, n: int, peak) -> dict:
    return {"layout": name, "step_s": seconds, "tokens_s": tokens / seconds,
            "tflops": flops / seconds / n / 1e12,
            "mfu": None if peak is None else flops / seconds / (n * peak)}


def one_device_rows(config, ratio: dict, steps: int, peak) -> list[dict]:
    """MFU on one device: the two steps of the ratio, then fiddlejax's step with fp8 matmuls."""
    b = ratio["batch_size"]
    flops = models.get("llama").flops_per_step(
        nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), b)
    rows = [row("hand-written jit(value_and_grad), bf16", ratio["theirs_s"], flops,
                b * config.seq_len, 1, peak),
            row("fiddlejax, bf16", ratio["ours_s"], flops, b * config.seq_len, 1, peak)]
    try:
        rows.append(layout_row(config, "fiddlejax, fp8 matmuls (e4m3/e5m2, current scaling)",
                               dict(data=1, matmul_dtype="fp8"), b, steps, peak))
    except Exception as e:  # noqa: BLE001 (reported in the table, the rest still runs)
        print(f"fp8 row failed: {type(e).__name__}: {e}", file=sys.stderr)
    return rows


def table(rows: list[dict], first: str = "layout") -> list[str]:
    lines = [f"| {first} | s/step | tokens/s | model TFLOP/s per device | MFU |",
             "|---|---|---|---|---|"]
    for r in rows:
        mfu = "n/a (peak unknown)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r['layout']} | {r['step_s']:.4f} | {r['tokens_s']:,.0f} | "
                     f"{r['tflops']:.3f} | {mfu} |")
    return lines


def report(device, params: int, ratio: dict, single: list[dict], rows: list[dict],
           smoke: bool) -> str:
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    lines = [f"# MFU: {'smoke run, ' if smoke else ''}Llama, {size} parameters, bf16",
             "", f"Device: {device.device_kind} ({device.platform}), "
             f"{len(jax.devices())} devices; jax {jax.__version__}; `python benchmarks/mfu.py"
             f"{' --smoke' if smoke else ''}`. XLA flags added: "
             f"{' '.join(f'--{k}={v}' for k, v in ADDED.items()) or 'none'}; XLA_FLAGS as run: "
             f"`{os.environ.get('XLA_FLAGS', '').strip() or 'empty'}`."
             + (" A CPU smoke run: it shows the script works, not how fast a GPU is; the GPU "
                "table is still to be measured." if smoke else ""), "",
             "## One device: fiddlejax step / hand-written jit(value_and_grad) step", "",
             "| fiddlejax s/step | hand-written s/step | ratio (median of rounds) |",
             "|---|---|---|",
             f"| {ratio['ours_s']:.4f} | {ratio['theirs_s']:.4f} | {ratio['ratio']:.3f} |", "",
             f"## One device, batch {ratio['batch_size']} x {ratio['seq_len']} tokens", "",
             *table(single, "step"), ""]
    if rows:
        lines += ["## Layouts on one node", "", *table(rows)]
    else:
        lines.append(f"Layouts on one node: not run ({len(jax.devices())} device(s); they "
                     "need 8).")
    return "\n".join(lines) + "\n"



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 8 simulated CPU devices")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per measurement")
    ap.add_argument("--rounds", type=int, default=None, help="alternated rounds of the ratio")
    ap.add_argument("--no-xla-flags", action="store_true",
                    help="leave XLA_FLAGS as given (fiddlejax.app.xla_flags sets none)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "mfu.md"))
    args = ap.parse_args(argv)
    config = SMOKE_CONFIG if args.smoke else GPU_CONFIG
    steps = args.steps or (2 if args.smoke else 10)
    device = jax.devices()[0]
    peak = peak_flops(device)
    ratio = one_device_ratio(config, 2 if args.smoke else 4,
                             args.rounds or (2 if args.smoke else 5), steps)
    single = one_device_rows(config, ratio, steps, peak)
    print(table(single, "step"), flush=True)
    rows = []
    if len(jax.devices()) >= 8:
        for name, kw in LAYOUTS:
            rows.append(layout_row(config, name, dict(kw), 16 if args.smoke else 32, steps, peak))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(
        nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), nnx.Param)))
    text = report(device, params, ratio, single, rows, args.smoke)
    reporting.write(Path(args.out), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
