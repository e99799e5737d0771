"""Mixtral-8x7B on 16 x 80 GB (or GPT-OSS-120B on 32): bf16, the planner's pick, compile only.

As ``benchmarks/scale_families.py`` does for dense families: the planner searches the layouts of
two 8-GPU H100 nodes for Mixtral-8x7B (``planner.preset("mixtral-8x7b")``: 46.7B parameters,
12.9B active; ``precision="bf16-mixed"``, full remat, 1F1B when pipelined, every expert size
the runtime has: ``fj.make_mesh(expert=)`` when it exists, else none) and picks the fastest that
fits. That layout is built as a real ``fj.Plan`` around the Mixtral decoder made from the
published ``config.json`` shape (``fiddlejax.models.decoder.FAMILIES["mixtral"]`` with
``nnx.eval_shape``: no weights exist), compiled on 16 simulated CPU devices, and
``trainer.memory(global_batch)`` gives the per-device bytes of one step, printed beside the
planner's figure (the bar: within 10%). Writes ``benchmarks/results/scale_moe.md``.

    python benchmarks/scale_moe.py [--layers N] [--seq 4096] [--layout T,P,D,E,MB ...]
    python benchmarks/scale_moe.py --model gpt-oss-120b

``--model gpt-oss-120b``: OpenAI's GPT-OSS-120B (``models.gpt_oss``, 116.8B parameters) on four
8-GPU nodes, written to ``results/scale_gpt_oss_120b.md``. Sixteen 80 GB GPUs cannot hold it
with float32 master weights and AdamW's two moments (16 bytes a parameter: 117 GB a GPU), so
the planner refuses 16 and the run starts at 32. ``--precision bf16 --gpus 16 --schedule 1f1b
--schedule zb-h1`` (``results/scale_gpt_oss_120b_bf16.md``): 16-bit parameters and moments
(float32 gradient accumulators: 10 bytes a parameter), compiled twice, as XLA's CPU compiles it
and with the converts of bf16 weights left in the layer loop (:data:`NO_HOIST`), the GPU's
figure.

``--layers N`` compiles N and 2N layers and extrapolates per layer, as scale.py, for a depth
too slow to compile whole (both frontier models compile whole: GPT-OSS-120B in seconds,
DeepSeek-V3 on 256 devices in under a minute). Both points should give every stage two
layers or more: a stage of one layer runs under a conditional, not a loop, and holds other
buffers (GPT-OSS-120B from 8 and 16 layers on 8 stages extrapolated to 89.4 GiB, more than
its whole 36 layers compile to).
``--layout`` (repeatable) compiles given layouts (tensor, pipe, data, expert, microbatch
size; 1F1B when pipelined) too, each a row after the pick's.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        many = 256 if "deepseek-v3" in sys.argv else 32
        os.environ["XLA_FLAGS"] = flags + f" --xla_force_host_platform_device_count={many}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402
from scale import markdown  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import planner  # noqa: E402

# mistralai/Mixtral-8x7B-v0.1's config.json
CONFIG = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
          "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
          "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False}
# openai/gpt-oss-120b's config.json (its MXFP4 quantization is a storage format: trained bf16)
GPT_OSS_120B = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
                "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False,
                                    "rope_theta": 150000.0,
                                    "original_max_position_embeddings": 4096},
                "swiglu_limit": 7.0, "router_aux_loss_coef": 0.0, "tie_word_embeddings": False}
# deepseek-ai/DeepSeek-V3's config.json (its fp8 weights are a storage format: trained bf16)
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "norm_topk_prob": True,
               "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
               "rope_theta": 10000, "num_nextn_predict_layers": 1,
               "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096},
               "tie_word_embeddings": False}
# name -> (family, config.json, GPUs, title); the planner's preset of the same name
MODELS = {"mixtral-8x7b": ("mixtral", CONFIG, 16, "Mixtral-8x7B"),
          "gpt-oss-120b": ("gpt_oss", GPT_OSS_120B, 32, "GPT-OSS-120B"),
          "deepseek-v3": ("deepseek_v3", DEEPSEEK_V3, 256, "DeepSeek-V3")}
GLOBAL_BATCH = 64


def has_expert_axis() -> bool:
    """Whether this fiddlejax has the ``expert`` mesh axis."""
    return "expert" in inspect.signature(fj.make_mesh).parameters


def decoder_class(family: str):
    if family == "deepseek_v3":
        from fiddlejax.models.deepseek import DeepseekV3

        return DeepseekV3
    if family == "gpt_oss":
        from fiddlejax.models.gpt_oss import GptOss

        return GptOss
    from fiddlejax.models.decoder import FAMILIES

    return FAMILIES[family]


def pick_layout(model: planner.ModelSpec, cluster: planner.ClusterSpec,
                precision: str = "bf16-mixed",
                schedules: tuple[str, ...] = ("1f1b",)) -> planner.Prediction:
    """The planner's fastest bf16, full-remat layout that fits (1F1B, or ``schedules``, when
    pipelined)."""
    return planner.search(model, cluster, GLOBAL_BATCH, precision=precision,
                          remats=("full",), schedules=schedules, microbatch_sizes=(1, 2, 4),
                          fsdp_gathers=("layer",), attention="xla",  # XLA's CPU compile
                          experts=None if has_expert_axis() else (1,))[0]


# XLA's CPU has no bf16 matmul: it converts each bf16 dot operand to float32, and its
# while-loop-invariant code motion hoists the converts of whole stacked weights and saved
# activations out of the layer loop (a float32 copy of each). A GPU runs those dots in bf16 with
# no converts, so 16-bit parameters are also compiled with that pass off (docs/planner.md).
NO_HOIST = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def compiled_memory(layout: planner.Layout, seq: int, layers: int, name: str) -> dict:
    """``peak_bytes`` of the compiled step; 16-bit parameters: also ``unhoisted_bytes``, the
    same step compiled with :data:`NO_HOIST`."""
    family, hf_config, _, _ = MODELS[name]
    cls = decoder_class(family)
    dense = hf_config.get("first_k_dense_replace", 0)  # kept whole: N layers are N MoE ones
    config = cls.config_from_hf({**hf_config, "num_hidden_layers": dense + layers}, seq_len=seq)
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    if layout.precision == "bf16":  # 16-bit parameters (docs/precision.md)
        nnx.update(model, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "bfloat16"),
                                       nnx.state(model, nnx.Param)))
    axes = dict(data=layout.data, pipe=layout.pipe, tensor=layout.tensor)
    if layout.expert > 1:
        axes["expert"] = layout.expert
    mesh = fj.make_mesh(**axes, devices=jax.devices()[:layout.gpus])
    plan = fj.Plan(mesh=mesh, schedule=layout.kind, microbatches=layout.microbatches,
                   virtual_stages=layout.virtual_stages, remat=layout.remat, zero=layout.zero,
                   fsdp_gather=layout.fsdp_gather, compute_dtype="bfloat16",
                   **({} if has_expert_axis() else {"rules": {"expert": None}}))
    trainer = fj.parallelize(model, optax.adamw(1e-4), plan)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in model.batch_spec(layout.global_batch).items()}
    lowered = trainer.lower_step(trainer.abstract_state(), batch)
    out = {"peak_bytes": peak_bytes(lowered.compile())}
    if layout.precision == "bf16":
        out["unhoisted_bytes"] = peak_bytes(lowered.compile(compiler_options=NO_HOIST))
    return out


def measure(seq: int, layers: int | None, given: tuple[int, ...] | None,
            name: str = "mixtral-8x7b", precision: str = "bf16-mixed",
            gpus: int | None = None, schedules: tuple[str, ...] = ("1f1b",)) -> dict:
    cluster = planner.cluster("h100", nodes=(gpus or MODELS[name][2]) // 8)
    model = planner.preset(name, seq=seq)
    if given:
        t, p, d, e, mb = given
        lo = planner.validate(planner.Layout(
            tensor=t, pipe=p, data=d, expert=e, microbatch_size=mb, global_batch=GLOBAL_BATCH,
            schedule=schedules[0] if p > 1 else None, remat="full", precision=precision,
            attention="xla"),
            model, cluster)
    else:
        lo = pick_layout(model, cluster, precision, schedules).layout
    hf = MODELS[name][1]
    total = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)
    t0 = time.perf_counter()
    key = "unhoisted_bytes" if precision == "bf16" else "peak_bytes"
    hoisted = None
    if layers is None or layers >= total:
        whole = compiled_memory(lo, seq, total, name)
        compiled = float(whole[key])
        hoisted = float(whole["peak_bytes"]) if key != "peak_bytes" else None
        how, points = "full compile", {}
    else:
        a = compiled_memory(lo, seq, layers, name)[key]
        b = compiled_memory(lo, seq, 2 * layers, name)[key]
        compiled = b + (total - 2 * layers) * (b - a) / layers
        how = f"{layers} and {2 * layers} layers, extrapolated"
        points = {layers: float(a), 2 * layers: float(b)}
    predicted = planner.memory(model, lo).total
    return {"model": name, "params": model.params, "gpus": lo.gpus, "layout": lo.short(),
            "microbatches": lo.microbatches, "global_batch": lo.global_batch, "seq": seq,
            "predicted": predicted, "compiled": compiled, "error": predicted / compiled - 1,
            "hbm": cluster.gpu.memory_bytes, "how": how, "compile_s": time.perf_counter() - t0,
            "points": points, "stages": lo.pipe * max(1, lo.virtual_stages or 1),
            "hoisted": hoisted,
            "parts": planner.memory(model, lo).to_dict()}


def hoisting(rows: list[dict]) -> str:
    """16-bit parameters: the compiled column is the step compiled with :data:`NO_HOIST`; what
    XLA's CPU compiles with its default passes, beside it."""
    out = [f"- {r['layout']}: {r['hoisted'] / 2**30:.2f} GiB as XLA's CPU compiles it by "
           f"default, {r['compiled'] / 2**30:.2f} GiB with `{NO_HOIST['xla_disable_hlo_passes']}`"
           " off (the compiled column). That pass hoists the float32 converts of whole bf16 "
           "weights and saved activations out of the layer loop (the largest values of a small "
           "bf16 GPT's CPU buffer assignment); a GPU runs bf16 dots without converts."
           for r in rows if r.get("hoisted")]
    return ("\n".join(out) + "\n") if out else ""


def slopes(rows: list[dict]) -> str:
    """The compiled points an extrapolated row is drawn through, and their slope per layer
    a stage (what a layer adds to the busiest stage)."""
    out = []
    for r in rows:
        if len(r["points"]) == 2:
            (n, a), (m, b) = sorted(r["points"].items())
            per = (b - a) / ((m - n) / r["stages"])
            out.append(f"- {r['layout']}: compiled {a / 2**30:.2f} GiB at {n} layers and "
                       f"{b / 2**30:.2f} GiB at {m} ({r['stages']} stages): "
                       f"{per / 2**30:.2f} GiB per layer a stage.")
    return ("\n".join(out) + "\n") if out else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, help="compile N and 2N layers and extrapolate")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layout", action="append", default=[],
                    help="T,P,D,E,MB: also compile this layout (repeatable)")
    ap.add_argument("--precision", choices=("bf16-mixed", "bf16"), default="bf16-mixed",
                    help="bf16: 16-bit parameters and Adam moments (docs/precision.md)")
    ap.add_argument("--gpus", type=int, help="default: the model's (16, 32 or 256)")
    ap.add_argument("--schedule", action="append", choices=("1f1b", "zb-h1"),
                    help="pipeline schedules the pick may use (repeatable; default 1f1b)")
    ap.add_argument("--out", help="default: results/scale_moe.md (Mixtral), else "
                    "results/scale_<model>[_bf16].md")
    a = ap.parse_args()
    family, _, gpus, title = MODELS[a.model]
    gpus = a.gpus or gpus
    stem = "scale_moe" if a.model == "mixtral-8x7b" else "scale_" + a.model.replace("-", "_")
    stem += "_bf16" if a.precision == "bf16" else ""
    out = Path(a.out or Path(__file__).parent / "results" / f"{stem}.md")
    rows = []
    for given in [None, *(tuple(int(x) for x in g.split(",")) for g in a.layout)]:
        rows.append(row := measure(a.seq, a.layers, given, a.model, a.precision, gpus,
                                   tuple(a.schedule or ("1f1b",))))
        print(markdown([row]).splitlines()[-1], f"({row['compile_s']:.0f} s)", flush=True)
        print("predicted parts (GiB):",
              {k: round(v / 2**30, 2) for k, v in row["parts"].items()})
    cmd = "python benchmarks/scale_moe.py" + (
        f" --model {a.model}" if a.model != "mixtral-8x7b" else "") + (
        f" --layers {a.layers}" if a.layers else "") + "".join(
        f" --layout {g}" for g in a.layout) + (
        f" --precision {a.precision}" if a.precision != "bf16-mixed" else "") + (
        f" --gpus {a.gpus}" if a.gpus else "") + "".join(
        f" --schedule {k}" for k in a.schedule or ())
    kinds = a.schedule or ["1f1b"]
    state = ("16-bit parameters and Adam moments (`--precision bf16`)"
             if a.precision == "bf16" else "float32 master weights and moments")
    axis = ("expert sizes dividing the experts considered" if has_expert_axis() else
            "no expert axis (this fiddlejax has none: experts replicated over data and pipe)")
    given = "; the rows after the first: layouts given with --layout" if a.layout else ""
    reporting.write(out,
        f"# Scale: {title} in bf16 on {gpus} x 80 GB, compile only\n\n"
        f"State: {state}. "
        f"`{cmd}`: the planner's fastest bf16 full-remat layout of {gpus // 8} 8 x H100 nodes "
        f"(90% of 80 GiB usable; {' or '.join(kinds).upper()} when pipelined; {axis}{given}), "
        "compiled as one "
        f"training step of the {title} decoder (`nnx.eval_shape`, real shapes, dropless "
        f"dispatch) on {gpus} simulated CPU devices; global batch {GLOBAL_BATCH} x {a.seq} "
        "tokens. "
        "Error = predicted / compiled - 1.\n\n" + markdown(rows) + "\n" + slopes(rows)
        + hoisting(rows))
    return 0  # a measurement: the error column says where the planner misses the 10% bar


if __name__ == "__main__":
    sys.exit(main())
