"""Published measurements the planner is validated against, and the comparison.

Megatron-LM 2021: D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti,
D. Vainbrand, P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473),
Table 1: weak scaling of GPT models on Selene (DGX A100 80GB, NVSwitch, 8 x 200 Gb/s HDR
InfiniBand per node), sequence 2048, vocabulary 51,200, mixed precision, activation
recomputation. Achieved TFLOP/s per GPU use the paper's FLOP count
96 B s l h^2 (1 + s / 6h + V / 16lh), which includes the recomputed forward.

Table 1 does not list microbatch size or schedule; the comparison assumes microbatch size 1
and non-interleaved 1F1B with full recomputation (stated next to every result), and Megatron's
placement of the embedding and head (``head="last-stage"``), which these runs used.
"""

from __future__ import annotations

import dataclasses

from fiddlejax.planner.cluster import cluster, nodes_for
from fiddlejax.planner.predict import predict
from fiddlejax.planner.space import Layout
from fiddlejax.planner.workload import gpt

SEQ, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of Megatron-LM 2021 Table 1."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipe: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, published


MEGATRON_2021_TABLE1: tuple[Run, ...] = (
    Run(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Run(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Run(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Run(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Run(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Run(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Run(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Run(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Run(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Run(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The paper's FLOPs per iteration (with activation recomputation)."""
    h = hidden
    return 96.0 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def compare(microbatch_size: int = 1, schedule: str = "1f1b") -> list[dict]:
    """Predicted vs published TFLOP/s per GPU for every Table 1 row."""
    rows = []
    for r in MEGATRON_2021_TABLE1:
        model = gpt(r.layers, r.hidden, r.heads, SEQ, VOCAB, name=f"gpt-{r.params_b}b")
        data = r.gpus // (r.tensor * r.pipe)
        c = cluster("a100-80gb", nodes=nodes_for(r.gpus))
        lo = Layout(tensor=r.tensor, pipe=r.pipe, data=data, microbatch_size=microbatch_size,
                    global_batch=r.batch, schedule=schedule if r.pipe > 1 else None,
                    remat="full", precision="bf16-mixed", head="last-stage")
        pr = predict(model, c, lo)
        flops = megatron_flops(r.batch, SEQ, r.layers, r.hidden, VOCAB)
        tflops = flops / pr.time.total / r.gpus / 1e12
        rows.append({
            "params_b": r.params_b, "tensor": r.tensor, "pipe": r.pipe, "data": data,
            "gpus": r.gpus, "batch": r.batch, "published_tflops": r.tflops_per_gpu,
            "predicted_tflops": tflops, "error": tflops / r.tflops_per_gpu - 1.0,
            "bubble_fraction": pr.bubble_fraction,
            "time": pr.time.to_dict(), "memory_gib": pr.memory.total / 2**30,
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """The comparison as a markdown table (with the mean absolute error)."""
    out = ["| params | t | p | d | GPUs | batch | published TFLOP/s | predicted | error | "
           "bubble | TP comm | DP comm |", "|" + "---|" * 12]
    for r in rows:
        tm = r["time"]
        tp, dp = tm["tensor_comm"] / tm["total"], tm["data_comm_exposed"] / tm["total"]
        out.append(
            f"| {r['params_b']}B | {r['tensor']} | {r['pipe']} | {r['data']} | {r['gpus']} | "
            f"{r['batch']} | {r['published_tflops']:.0f} | {r['predicted_tflops']:.0f} | "
            f"{r['error']:+.1%} | {r['bubble_fraction']:.1%} | "
            f"{tp:.1%} | {dp:.1%} |")
    mae = sum(abs(r["error"]) for r in rows) / len(rows)
    out.append("")
    worst = max(rows, key=lambda r: abs(r["error"]))
    out.append(f"Mean absolute error {mae:.1%}; worst {worst['params_b']}B at "
               f"{worst['error']:+.1%}.")
    return "\n".join(out)
