"""fiddlejax schedules against a MaxText/praxis-style pipeline, side by side in one run.

The baseline is the technique public SPMD JAX libraries use: stage parameters stacked on a
leading axis sharded over ``pipe``, a ``lax.scan`` over m + p - 1 iterations whose body runs every
stage at once with ``vmap`` and shifts the activations one stage along (GSPMD turns the shift into
a collective-permute), and ``jax.grad`` through the whole loop. Autodiff of that loop executes
GPipe order: every iteration's residuals are kept for the backward, so activation memory grows
with the microbatch count.

Both sides train the same GPT on the same mesh (pipe=4) with the same microbatches; we report
compiled temp memory and the median step-time ratio over alternating timed runs.

    python benchmarks/pipeline_vs_baseline.py [--quick]
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.adaptation.split import split_model  # noqa: E402
from fiddlejax.models.gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=8, d_ff=256)
PIPE, MB = 4, 2  # stages; sequences per microbatch


def baseline_step(model, mesh, m: int):
    """A jitted GPipe-by-autodiff SGD step (the MaxText-style baseline) and its inputs."""
    sm, params = split_model(model)
    stack = sm.stack
    lps = sm.num_layers // PIPE

    def to_stages(v):
        return v.reshape(PIPE, lps, *v.shape[1:])

    stage_params = jax.tree.map(to_stages, params[stack])
    shard = NamedSharding(mesh, P("pipe"))
    stage_params = jax.device_put(stage_params, shard)

    def stage_fn(sp, x):
        return jax.lax.scan(lambda h, lp: (sm.layer(lp, h), None), x, sp)[0]

    def loss_fn(all_params, sp, batch):
        mbs = jax.tree.map(lambda a: a.reshape(m, MB, *a.shape[1:]), batch)
        xs = jax.vmap(lambda b: sm.prologue(all_params, b))(mbs)  # a message, [m, MB, T, D]
        tmap = jax.tree.map
        state = tmap(lambda a: jnp.zeros((PIPE, *a.shape[1:]), a.dtype), xs)
        state = jax.lax.with_sharding_constraint(state, shard)
        inputs = tmap(lambda a: jnp.concatenate(
            [a, jnp.zeros((PIPE - 1, *a.shape[1:]), a.dtype)]), xs)

        def body(state, x_in):
            state = tmap(lambda s, x: s.at[0].set(x), state, x_in)
            state = jax.vmap(stage_fn)(sp, state)
            state = jax.lax.with_sharding_constraint(state, shard)
            out = tmap(lambda s: s[-1], state)
            state = tmap(lambda s: jnp.roll(s, 1, axis=0), state)  # s -> s + 1 (a permute)
            return state, out

        _, outs = jax.lax.scan(body, state, inputs)
        # microbatch i leaves the last stage at iteration i + p - 1
        ys = tmap(lambda o: o[PIPE - 1:], outs)
        losses = jax.vmap(lambda y, b: sm.epilogue(all_params, y, b))(ys, mbs)
        return losses.mean()

    @jax.jit
    def step(all_params, sp, batch):
        loss, (g_all, g_sp) = jax.value_and_grad(loss_fn, argnums=(0, 1))(all_params, sp, batch)
        upd = lambda p, g: p - 1e-3 * g  # noqa: E731
        return jax.tree.map(upd, all_params, g_all), jax.tree.map(upd, sp, g_sp), loss

    return step, params, stage_params


def fiddlejax_step(model, mesh, kind: str, m: int, v: int):
    plan = fj.Plan(mesh=mesh, schedule=kind, microbatches=m, virtual_stages=v)
    trainer = fj.parallelize(model, optax.sgd(1e-3), plan)
    return trainer


def median_ratio(run_a, run_b, repeats: int) -> float:
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((run_a, ta), (run_b, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta) / statistics.median(tb)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    ms = [4, 16] if args.quick else [4, 8, 16, 32]
    repeats = 3 if args.quick else 7
    mesh = fj.make_mesh(data=1, pipe=PIPE, tensor=1, devices=jax.devices()[:PIPE])
    model = GPT(CFG, rngs=nnx.Rngs(0))
    rows = []
    for m in ms:
        batch = {"tokens": np.random.default_rng(m).integers(
            0, 256, (m * MB, CFG.seq_len + 1)).astype(np.int32)}
        bstep, params, sp = baseline_step(model, mesh, m)
        bcomp = bstep.lower(params, sp, batch).compile()
        b_temp = bcomp.memory_analysis().temp_size_in_bytes
        b_loss = float(bstep(params, sp, batch)[2])

        def run_baseline(bstep=bstep, params=params, sp=sp, batch=batch):
            jax.block_until_ready(bstep(params, sp, batch))

        for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]:
            trainer = fiddlejax_step(model, mesh, kind, m, v)
            state = trainer.init()
            sb = trainer.shard_batch(batch)
            f_temp = trainer.compiled_step(state, sb).memory_analysis().temp_size_in_bytes
            loss, _ = trainer.loss_and_grads(state, batch)
            assert abs(float(loss) - b_loss) < 1e-4 * abs(b_loss), (float(loss), b_loss)
            fstep = trainer.step_function()  # no donation: reuse the same state

            def run_fj(fstep=fstep, state=state, sb=sb):
                jax.block_until_ready(fstep(state, sb))

            run_fj()
            run_baseline()
            ratio = median_ratio(run_fj, run_baseline, repeats)
            rows.append((m, kind, v, f_temp, b_temp, ratio))
            print(f"m={m:3d} {kind:17s} temp {f_temp / 2**20:7.2f} MiB vs baseline "
                  f"{b_temp / 2**20:7.2f} MiB; step time ratio {ratio:.2f}", flush=True)
    out = ["# fiddlejax schedules vs a MaxText-style pipeline (GPipe by autodiff)", "",
           f"GPT d=64, 8 layers, seq 64; pipe={PIPE}, {MB} sequences per microbatch; CPU, "
           "8 simulated devices. Time ratio = median fiddlejax step / median baseline step "
           f"({repeats} alternating runs each); < 1 means fiddlejax is faster.", "",
           "| m | schedule | fiddlejax temp | baseline temp | memory ratio | time ratio |",
           "|---|---|---|---|---|---|"]
    for m, kind, v, ft, bt, r in rows:
        name = kind + (f" (v={v})" if v > 1 else "")
        out.append(f"| {m} | {name} | {ft / 2**20:.2f} MiB | {bt / 2**20:.2f} MiB | "
                   f"{ft / bt:.2f} | {r:.2f} |")
    path = Path(__file__).parent / "results" / "pipeline_vs_baseline.md"
    path.parent.mkdir(exist_ok=True)
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
