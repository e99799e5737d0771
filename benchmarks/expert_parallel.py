"""Expert parallelism on the CPU: what the ``expert`` axis's all-to-all costs.

A stack of MoE layers (``models/moe.py``, dropless, the blocked grouped matmul) trained on 8
simulated devices as ``data=8`` (expert=1: every device holds every expert) and as
``data=8/E x expert=E``: the same global batch, the same devices. For each layout: the
collectives of the compiled loss-and-gradients step counted from its HLO (per kind, the bytes
of their results per device; a loop body, i.e. one layer of the layer scan, counted once), each
device's share of the expert weights, the compiled temporary memory (exact), and the step time
as a ratio to expert=1 (steps alternate in one run; medians).

``--check`` also runs the acceptance layouts once, each against the single-device loss (router
losses included) and gradients: expert=2 x data=2 x tensor=2, expert=2 x pipe=2 x data=2 with
1F1B and with interleaved 1F1B, and expert=2 x data=2 x tensor=2 with zero=3.

    python benchmarks/expert_parallel.py [--quick] [--check]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
jax.config.update("jax_default_matmul_precision", "highest")

import reporting  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.moe import MoEConfig, route  # noqa: E402
from fiddlejax.models.moe_lm import MoELM  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "expert_parallel.md"
KINDS = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def collectives(hlo: str) -> dict:
    """``{kind: (count, bytes per device)}`` of the collectives in compiled HLO text."""
    out = {k: [0, 0] for k in KINDS}
    for m in re.finditer(r"= (.+?) (" + "|".join(KINDS) + r")(?:-start)?\(", hlo):
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        size = sum(BYTES.get(t, 4) * int(np.prod([int(s) for s in dims.split(",") if s]))
                   for t, dims in shapes)
        out[m.group(2)][0] += 1
        out[m.group(2)][1] += size
    return {k: tuple(v) for k, v in out.items()}


def batch(rows: int, seq: int, vocab: int, seed: int = 3) -> dict:
    t = jax.random.randint(jax.random.key(seed), (rows, seq + 1), 0, vocab, jnp.int32)
    return {"tokens": np.asarray(t)}


def build(cfg: MoEConfig, expert: int, layers: int, vocab: int, **plan):
    model = MoELM(cfg, vocab, layers, nnx.Rngs(0), report=False)
    sizes = {"data": 8 // expert, "expert": expert} if "mesh" not in plan else {}
    mesh = plan.pop("mesh", None) or fj.make_mesh(**sizes)
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=mesh, **plan))
    return model, trainer


def measure(cfg: MoEConfig, experts: list[int], layers: int, vocab: int, rows: int, seq: int,
            repeats: int) -> dict:
    b = batch(rows, seq, vocab)
    runs = {}
    for e in experts:
        _, trainer = build(cfg, e, layers, vocab)
        state = trainer.init()
        compiled = trainer.lower_loss_and_grads(state, b).compile()
        weights = [v for p, v in jax.tree_util.tree_leaves_with_path(state.params)
                   if "'w_" in jax.tree_util.keystr(p)]
        share = (sum(max(s.data.nbytes for s in w.addressable_shards) for w in weights)
                 / sum(w.nbytes for w in weights))
        runs[e] = {"fn": lambda s=state, t=trainer: t.loss_and_grads(s, b), "share": share,
                   "temp": compiled.memory_analysis().temp_size_in_bytes,
                   "comm": collectives(compiled.as_text())}
        jax.block_until_ready(runs[e]["fn"]())
    times = {e: [] for e in runs}
    for _ in range(repeats):
        for e, r in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(r["fn"]())
            times[e].append(time.perf_counter() - t0)
    base = statistics.median(times[experts[0]])
    for e in runs:
        runs[e]["ratio"] = statistics.median(times[e]) / base
    return runs


def rows_run(cfg: MoEConfig, vocab: int, rows: int, seq: int, expert: int,
             block: int = 128) -> tuple[float, float]:
    """Expert matmul rows run per real (token, expert) pair, layer 0's routing at init:
    ``(blocked loop, static blocks)``. The blocked matmul runs, on every device of a data
    replica, the blocks of ``most`` (each local expert's most rows on any device, rounded up
    to blocks); a loop over every block of the all-to-all buffer (the static bound) runs
    ``ceil((S * rows + E/S * (block - 1)) / block)``."""
    model = MoELM(cfg, vocab, 1, nnx.Rngs(0), report=False)
    tokens = batch(rows, seq, vocab)["tokens"][:, :-1]
    x = jnp.take(model.embed[...], tokens, axis=0).reshape(-1, cfg.hidden_size)
    h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
    logits = h @ model.blocks.moe.router[...][0]
    _, chosen = route(logits, cfg.num_experts_per_tok)
    k, e, s = cfg.num_experts_per_tok, cfg.num_experts, expert
    local, replicas = e // s, 8 // s
    per = np.asarray(chosen).reshape(replicas, -1, k)  # each data replica's tokens
    n = per.shape[1] // s
    run = static = 0
    for r in per:
        counts = np.bincount(r.reshape(-1), minlength=e).reshape(s, local)  # [device, local]
        run += s * block * int(np.sum(-(-counts.max(axis=0) // block)))
        static += s * block * (-(-(s * n * min(k, local) + local * (block - 1)) // block))
    real = rows * seq * k
    return run / real, static / real


def check(cfg: MoEConfig) -> list[str]:
    """The acceptance layouts against one device: loss and gradient relative errors."""
    def ref_loss_grads(model, b):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return fj.mean_loss(m.loss(m.head(_scan(m, m.prologue(b))), b))

        return jax.jit(jax.value_and_grad(loss))(params)

    layouts = [
        ("expert=2 x data=2 x tensor=2", {"data": 2, "expert": 2, "tensor": 2},
         {"microbatches": 2}),
        ("expert=2 x pipe=2 x data=2, 1f1b", {"data": 2, "pipe": 2, "expert": 2},
         {"schedule": "1f1b", "microbatches": 2}),
        ("expert=2 x pipe=2 x data=2, interleaved-1f1b", {"data": 2, "pipe": 2, "expert": 2},
         {"schedule": "interleaved-1f1b", "microbatches": 2, "virtual_stages": 2}),
        ("expert=2 x data=2 x tensor=2, zero=3", {"data": 2, "expert": 2, "tensor": 2},
         {"zero": 3, "microbatches": 2}),
    ]
    b = batch(8, 8, 32)
    rows = []
    for name, sizes, plan in layouts:
        model = MoELM(cfg, 32, 4, nnx.Rngs(0))
        ref_loss, ref_grads = ref_loss_grads(model, b)
        trainer = fj.parallelize(model, optax.sgd(0.1),
                                 fj.Plan(mesh=fj.make_mesh(**sizes), **plan))
        t0 = time.perf_counter()
        loss, grads = trainer.loss_and_grads(trainer.init(), b)
        seconds = time.perf_counter() - t0
        err = _rel(grads, ref_grads)
        rows.append(f"| {name} | {abs(float(loss) / float(ref_loss) - 1):.1e} | {err:.1e} | "
                    f"{seconds:.0f} |")
        print(rows[-1], flush=True)
    return rows


def _scan(m, x):
    from fiddlejax.models.common import scan_layers

    return scan_layers(m.blocks, x)


def _rel(a, b) -> float:
    fa = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)])
    fb = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)])
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="expert=1 and 2 only, 3 repeats")
    ap.add_argument("--check", action="store_true", help="also the four acceptance layouts")
    args = ap.parse_args()
    cfg = MoEConfig(hidden_size=128, intermediate_size=256, num_experts=8,
                    num_experts_per_tok=2, router_aux_loss_coef=0.01)
    experts, repeats = ([1, 2], 3) if args.quick else ([1, 2, 4, 8], 7)
    layers, vocab, rows, seq = 2, 256, 16, 128
    runs = measure(cfg, experts, layers, vocab, rows, seq, repeats)
    table = []
    for e, r in runs.items():
        comm = r["comm"]
        a2a, other = comm["all-to-all"], {k: v for k, v in comm.items() if k != "all-to-all"}
        rest = ", ".join(f"{k} {n} / {b / 2**10:.0f}" for k, (n, b) in other.items() if n)
        table.append(f"| data={8 // e} x expert={e} | {a2a[0]} / {a2a[1] / 2**10:.0f} | {rest} | "
                     f"{r['share']:.3f} | {r['temp'] / 2**20:.1f} | {r['ratio']:.2f}x |")
        print(table[-1], flush=True)
    checks = check(small(cfg)) if args.check else []
    tokens = rows * seq
    padding = [f"| {e} | {q} x {sq} | {a:.2f}x | {b:.2f}x |" for e in experts if e > 1
               for q, sq in ((rows, seq), (rows, 4096))
               for a, b in [rows_run(cfg, vocab, q, sq, e)]]
    lines = [
        "# Expert parallelism: the all-to-all's cost (CPU)", "",
        f"`python benchmarks/expert_parallel.py{' --check' if args.check else ''}` on jax "
        f"{jax.__version__}, 8 simulated CPU devices. {layers} MoE layers (`models/moe.py`, "
        f"dropless, blocked grouped matmul), {cfg.num_experts} experts, top-"
        f"{cfg.num_experts_per_tok}, d={cfg.hidden_size}, expert width "
        f"{cfg.intermediate_size}, vocabulary {vocab}; one loss-and-gradients step of "
        f"{rows} x {seq} = {tokens} tokens, float32. Collectives: count / KiB per device of "
        "their results in the compiled HLO, a loop body (one layer of the layer scan, "
        "forward and backward) counted once; expert share: each device's bytes of the expert "
        "weights over their total; temp: `memory_analysis().temp_size_in_bytes`, exact; time: "
        f"median of {repeats} alternating steps over expert=1's.", "",
        "| layout | all-to-all (count / KiB) | other collectives (count / KiB) | expert share | "
        "temp MiB | step time / expert=1 |",
        "|---|---|---|---|---|---|", *table, "",
        "The all-to-all buffers are static: each destination gets room for the most pairs a "
        "shard can send it, `n x min(k, E/S)` rows, where `n x k` pairs are really sent "
        "(XLA's CPU has no `ragged_all_to_all`), so they carry `S x min(k, E/S) / k` times the "
        "real pairs: 2x at expert=2, 4x at expert=4 and 8 here. In exchange the expert "
        "weights' gradients leave the all-reduce (each expert lives on one device of its "
        "data replica) and each device holds 1/S of them and of their optimizer state. Times "
        "come from a 2-core machine shared with other jobs: ratios of medians, good to "
        "perhaps 20%; bytes and memory are exact.", "",
    ]
    lines += [
        "## Expert matmul rows per real pair", "",
        "The blocked grouped matmul (`models/grouped.py`) runs only the blocks that hold "
        "rows: on every device of a data replica, each local expert's most rows on any of them "
        "(one loop length for the replica), rounded up to 128-row blocks; the buffers' padding "
        "rows are not run. Rows run per real (token, expert) pair, from layer 0's routing at "
        "initialization (`rows_run` in the script), against a loop over every block the "
        "static all-to-all buffer can fill (what ran before):", "",
        "| expert | tokens | rows run / real pairs | static blocks / real pairs |",
        "|---|---|---|---|", *padding, ""]
    if checks:
        lines += ["## Acceptance layouts against one device", "",
                  "4 MoE layers, 4 experts, top-2, d=16, aux 0.5 and z 0.1 coefficients, "
                  "8 x 8 tokens; relative errors, float32; seconds: the first call "
                  "(compile and run).", "",
                  "| layout | loss rel. err. | gradients rel. err. | seconds |",
                  "|---|---|---|---|", *checks, ""]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    reporting.write(RESULTS, "\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def small(cfg: MoEConfig) -> MoEConfig:
    """The acceptance checks' small model: 4 experts, large router-loss coefficients."""
    import dataclasses

    return dataclasses.replace(cfg, hidden_size=16, intermediate_size=24, num_experts=4,
                               router_aux_loss_coef=0.5, router_z_loss_coef=0.1)


if __name__ == "__main__":
    raise SystemExit(main())
