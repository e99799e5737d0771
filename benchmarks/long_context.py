"""Llama-3-8B at 128k tokens per sequence on 8 x 80 GB: the planner's layout, compile only.

The planner searches every layout of one 8 x H100 (80 GB, 72 GiB usable) node for Llama-3-8B
with ``seq_len`` tokens per sequence (one sequence per step, ``precision="bf16-mixed"``,
remat as it picks) and takes the fastest that fits; that layout is built as an ``fj.Plan``
around ``models.llama.Llama`` made with ``nnx.eval_shape`` (no weights exist) and one training
step (AdamW) is lowered and compiled on 8 simulated CPU devices in a subprocess:
``trainer.memory(1)["peak_bytes"]`` (argument + output + temp - aliased) against the
planner's figure. Writes ``benchmarks/results/long_context.md``.

    python benchmarks/long_context.py [--seq 131072 32768] [--layout T,C,SP,ZERO,REMAT]
    python benchmarks/long_context.py --platform gpu   # on a machine with one NVIDIA GPU

The planner picks for the first ``--seq``; the shorter ones compile that same layout, to show
the trend.

On the CPU XLA computes bf16 elementwise work in float32; the compiled bytes are XLA's CPU
buffers, compared as they are. ``--platform gpu`` compiles the same step with XLA's GPU
compiler for 8 GPUs on a machine that has one: JAX's mock topology
(``jax_mock_gpu_topology=1x8x1``, mock NCCL) presents 8 devices, of which only the first is
real, so the step compiles (with the job's GPU flags, ``fiddlejax.app.xla_flags``, autotuning off)
but never runs; results go to ``long_context_gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import reporting

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8)


def pick(seq: int, layout):
    """The planner's fastest layout that fits (or ``layout``: a ``planner.Layout``, or a
    ``T,C,SP,ZERO,REMAT`` string) and its prediction."""
    from fiddlejax import planner

    spec = planner.preset("llama3-8b", seq=seq)
    cluster = planner.cluster("h100", nodes=1)
    if isinstance(layout, str):
        t, c, sp, zero, remat = layout.split(",")
        layout = planner.Layout(tensor=int(t), context=int(c), data=8 // (int(t) * int(c)),
                                sequence_parallel=sp == "sp", zero=int(zero), remat=remat,
                                global_batch=8 // (int(t) * int(c)), precision="bf16-mixed",
                                attention="xla")  # what XLA compiles here
    if layout is not None:
        return planner.predict(spec, cluster, layout)
    return planner.search(spec, cluster, 1, precision="bf16-mixed", microbatch_sizes=(1,),
                          top=1, attention="xla")[0]


def compile_step(seq: int, lo: dict) -> dict:
    """In the subprocess: compile one step of the layout ``lo`` (``Layout.to_dict()``)."""
    import jax
    import optax
    from flax import nnx

    import fiddlejax as fj
    from fiddlejax.models.llama import Llama, LlamaConfig

    if os.environ.get("JAX_MOCK_GPU_TOPOLOGY"):  # JAX reads this option only from its config
        jax.config.update("jax_mock_gpu_topology", os.environ["JAX_MOCK_GPU_TOPOLOGY"])
    config = LlamaConfig(**SHAPE, seq_len=seq, max_position_embeddings=seq)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    mesh = fj.make_mesh(data=lo["data"], pipe=lo["pipe"], context=lo["context"],
                        tensor=lo["tensor"], devices=jax.devices()[:lo["gpus"]])
    plan = fj.Plan(mesh=mesh, schedule=lo["schedule"], microbatches=lo["microbatches"],
                   virtual_stages=lo["virtual_stages"], remat=lo["remat"], zero=lo["zero"],
                   sequence_parallel=lo["sequence_parallel"], fsdp_gather=lo["fsdp_gather"],
                   compute_dtype="bfloat16" if lo["precision"] == "bf16-mixed" else "float32")
    t0 = time.perf_counter()
    trainer = fj.parallelize(model, optax.adamw(1e-4), plan)
    out = trainer.memory(lo["global_batch"])
    return {**out, "compile_s": time.perf_counter() - t0, "jax": jax.__version__,
            "device": jax.devices()[0].device_kind}


def compile_env(platform: str) -> dict:
    """The compiling subprocess's environment: 8 simulated CPU devices, or 8 mock GPUs (one
    real) with the GPU flags the job sets."""
    env = {**os.environ,
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if platform == "cpu":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + " --xla_force_host_platform_device_count=8").strip()
        env["JAX_PLATFORMS"] = "cpu"
        return env
    from fiddlejax.app import xla_flags

    env.update(JAX_PLATFORMS="cuda", JAX_MOCK_GPU_TOPOLOGY="1x8x1",
               JAX_CUDA_VISIBLE_DEVICES="0", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # autotuning times kernels it will never run (with it the 128k step did not compile in 7
    # minutes on an H200; without it, in one)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    xla_flags.apply(gpu=True, environ=env)
    return env


def measure(seq: int, layout, platform: str = "cpu") -> dict:
    pr = pick(seq, layout)
    env = compile_env(platform)
    run = subprocess.run([sys.executable, __file__, "--compile", str(seq),
                          json.dumps(pr.layout.to_dict())], env=env, capture_output=True,
                         text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"compile of {pr.layout.short()} at seq {seq} failed:\n"
                           f"{run.stderr[-3000:]}")
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    mem = pr.memory.to_dict()
    return {"seq": seq, "layout": pr.layout.short(), "lo": pr.layout, "predicted": mem["total"],
            "breakdown": mem, "compiled": compiled, "tokens_per_second": pr.tokens_per_second,
            "error": mem["total"] / compiled["peak_bytes"] - 1}


def markdown(rows: list[dict]) -> str:
    lines = ["| seq | layout (planner's pick at the first seq) | predicted | compiled peak "
             "| error | compiled arguments | compiled temp | fits 80 GB | compile |",
             "|---" * 9 + "|"]
    for r in rows:
        c = r["compiled"]
        lines.append(
            f"| {r['seq']} | {r['layout']} | {r['predicted'] / GIB:.2f} GiB "
            f"| {c['peak_bytes'] / GIB:.2f} GiB | {r['error']:+.1%} "
            f"| {c['argument_bytes'] / GIB:.2f} GiB | {c['temp_bytes'] / GIB:.2f} GiB "
            f"| {'yes' if c['peak_bytes'] <= 80e9 else 'NO'} | {c['compile_s']:.0f} s |")
    lines += ["", "Predicted, by what it holds (GiB):", "",
              "| seq | params | grads | optimizer | activations | working |", "|---" * 6 + "|"]
    for r in rows:
        b = r["breakdown"]
        lines.append(f"| {r['seq']} | " + " | ".join(
            f"{b[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "activations",
                                           "working")) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[131072, 32768],
                    help="the planner picks for the first; the others compile its layout")
    ap.add_argument("--layout", metavar="T,C,SP,ZERO,REMAT",
                    help="this layout instead of the planner's pick, e.g. 1,8,-,3,full; "
                    "prints its rows, writes nothing")
    ap.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                    help="compile with XLA's CPU compiler (8 simulated devices) or its GPU "
                    "compiler (8 mock GPUs; needs one real NVIDIA GPU)")
    ap.add_argument("--compile", nargs=2, metavar=("SEQ", "LAYOUT_JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help="the results file (default benchmarks/results/"
                    "long_context.md, long_context_gpu.md with --platform gpu)")
    a = ap.parse_args()
    a.out = a.out or str(ROOT / "benchmarks" / "results" / (
        "long_context_gpu.md" if a.platform == "gpu" else "long_context.md"))
    if a.compile:
        print(json.dumps(compile_step(int(a.compile[0]), json.loads(a.compile[1]))))
        return 0
    rows = []
    for seq in a.seq:  # the first length's pick, compiled at the others too (the trend)
        rows.append(measure(seq, a.layout or (rows[0]["lo"] if rows else None), a.platform))
        print(markdown(rows[-1:]).splitlines()[2], flush=True)
    table = markdown(rows)
    print(table)
    if not a.layout:
        where = ("on 8 simulated CPU devices" if a.platform == "cpu" else
                 f"by XLA's GPU compiler (jax {rows[0]['compiled']['jax']}, one "
                 f"{rows[0]['compiled']['device']} and 7 mock GPUs: "
                 "`jax_mock_gpu_topology=1x8x1`, with the job's GPU XLA flags)")
        reporting.write(Path(a.out),
            "# Long context: Llama-3-8B at 128k tokens on 8 x 80 GB, compile only\n\n"
            f"`python benchmarks/long_context.py --platform {a.platform}`: the planner picks "
            "the fastest layout of one 8 x H100 node (72 GiB usable per GPU) for one "
            "131,072-token sequence per step in bf16-mixed (the 32k row compiles the same "
            "layout, for the trend); "
            "the Trainer compiles one AdamW step of `models.llama.Llama` (Llama-3-8B shapes, "
            f"built with `nnx.eval_shape`) {where}; compiled = "
            "`trainer.memory(1)['peak_bytes']`; error = predicted / compiled - 1.\n\n"
            + table)
    return 0 if abs(rows[0]["error"]) < 0.10 else 1  # the planner's pick, at its length


if __name__ == "__main__":
    sys.exit(main())
