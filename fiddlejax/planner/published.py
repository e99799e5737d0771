"""Published training runs the planner is validated against, each predicted as it ran.

Megatron-LM 2021: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: GPT weak scaling on Selene
(DGX A100 80GB, NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node), sequence 2048, vocabulary
51,200. The table omits how each row ran; NVIDIA's reproduction script for it
(Megatron-LM ``examples/sc21/run_table_1.sh`` with ``CONFIG.sh``) gives it: fp16 with loss
scaling, full recomputation (``--activations-checkpoint-method uniform``), the microbatch size,
interleaving (``--num-layers-per-virtual-pipeline-stage``) and the data-parallel
implementation of each row. PyTorch's DDP (rows without a pipeline) all-reduces the fp16
gradients inside the last microbatch's backward; Megatron's local DDP (pipelined rows) after
it. Megatron-LM 2021's pipeline batches one send and one receive per action and waits for them
(``batch_isend_irecv`` + ``cuda.synchronize``), with the scatter/gather optimization; every
microbatch's gradient is added into the fp16 ``main_grad`` by its own kernel.

BLOOM-176B: BigScience's run (bigscience ``train/tr11-176B-ml``: README and slurm script) on
Jean Zay (48 nodes of 8 A100-80GB, 4 x 100 Gb/s Omni-Path per node), Megatron-DeepSpeed: TP4
PP12 DP8, microbatch 2, global batch 2048, bf16 with DeepSpeed's BF16_Optimizer (its own ZeRO-1,
gradients accumulated per microbatch in float32 and all-reduced in float32), full
recomputation, ``--pp-partition-method type:transformer|embedding``, DeepSpeed's pipeline
engine (blocking sends and receives, activations partitioned over the tensor ranks). Published:
149.77 TFLOP/s per GPU at 104.70 s per iteration (the README's log line at iteration 85,376).

Every published figure uses the Megatron formula 96 B s l h^2 (1 + s/6h + V/16lh), which is
the planner's executed FLOPs with full recomputation; a run names the placement of its
embedding and head (all of these: Megatron's, ``head="last-stage"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fiddlejax.planner.cluster import ClusterSpec, cluster, nodes_for
from fiddlejax.planner.predict import predict
from fiddlejax.planner.space import Layout
from fiddlejax.planner.workload import ModelSpec, gpt, preset

SEQ, VOCAB = 2048, 51200
BAR = 0.15  # `fiddlejax plan validate` fails when a run is further off than this (issue 52's
# bar; 0.10 before the head of an interleaved Megatron stage was charged once per microbatch
# instead of once per chunk, which moved gpt-76.1b from +8.1% to +10.9%)


@dataclasses.dataclass(frozen=True)
class Run:
    """One published measurement: the model, the cluster and layout it ran, its figure."""

    name: str
    source: str
    model: ModelSpec
    cluster: str
    layout: Layout
    tflops_per_gpu: float  # achieved hardware TFLOP/s per GPU, published

    @property
    def placement(self) -> str:
        return "Megatron (first/last stage)" if self.layout.head == "last-stage" else "fiddlejax"


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The paper's FLOPs per iteration (with activation recomputation)."""
    h = hidden
    return 96.0 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def _megatron(params_b: float, heads: int, hidden: int, layers: int, tensor: int, pipe: int,
              gpus: int, batch: int, tflops: float, mbs: int,
              layers_per_virtual: int | None = None) -> Run:
    """A Table 1 row with its settings from ``run_table_1.sh``."""
    v = layers // pipe // layers_per_virtual if layers_per_virtual else 1
    lo = Layout(tensor=tensor, pipe=pipe, data=gpus // (tensor * pipe), virtual_stages=v,
                microbatch_size=mbs, global_batch=batch, remat="full", precision="bf16-mixed",
                head="last-stage", grad_bytes=2, grad_accumulation="separate",
                rank_order="pipe-data-tensor", p2p="batched" if pipe > 1 else "async",
                dp_overlap=1.0 if pipe == 1 else 0.0,  # torch DDP without a pipeline
                attention="xla")  # fused softmax kernels writing the s x s scores, no flash
    return Run(f"gpt-{params_b}b", "Megatron-LM 2021, Table 1",
               gpt(layers, hidden, heads, SEQ, VOCAB, tied=True, name=f"gpt-{params_b}b"),
               "a100-80gb",
               lo, tflops)


RUNS: tuple[Run, ...] = (
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    _megatron(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    _megatron(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    _megatron(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    _megatron(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    _megatron(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    _megatron(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5),
    _megatron(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    _megatron(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
    Run("bloom-176b", "BigScience tr11-176B-ml", preset("bloom-176b"), "jean-zay-a100",
        Layout(tensor=4, pipe=12, data=8, microbatch_size=2, global_batch=2048, remat="full",
               zero=1, precision="bf16-mixed", head="last-stage", partition="layers+head",
               p2p="blocking", grad_accumulation="cast-add", rank_order="pipe-data-tensor",
               attention="xla"),  # Megatron-DeepSpeed's fused softmax: scores in HBM
        149.77),
)
MEGATRON_2021_TABLE1 = tuple(r for r in RUNS if r.source.startswith("Megatron-LM 2021"))


def compare(runs: tuple[Run, ...] | None = None,
            adjust: Callable[[ClusterSpec], ClusterSpec] | None = None) -> list[dict]:
    """Predicted vs published hardware TFLOP/s per GPU for every run (default: ``RUNS``);
    ``adjust`` changes each run's cluster first (``attribution`` turns efficiencies off)."""
    rows = []
    for r in RUNS if runs is None else runs:
        m, lo = r.model, r.layout
        c = cluster(r.cluster, nodes=nodes_for(lo.gpus))
        pr = predict(m, adjust(c) if adjust else c, lo)
        flops = megatron_flops(lo.global_batch, m.seq_len, m.num_layers, m.hidden, m.vocab)
        tflops = flops / pr.time.total / lo.gpus / 1e12
        rows.append({
            "run": r.name, "source": r.source, "placement": r.placement,
            "cluster": r.cluster, "layout": lo.short(), "tensor": lo.tensor, "pipe": lo.pipe,
            "data": lo.data, "gpus": lo.gpus, "batch": lo.global_batch,
            "published_tflops": r.tflops_per_gpu, "predicted_tflops": tflops,
            "error": tflops / r.tflops_per_gpu - 1.0, "bubble_fraction": pr.bubble_fraction,
            "time": pr.time.to_dict(), "memory_gib": pr.memory.total / 2**30,
        })
    return rows


def off(rows: list[dict], bar: float = BAR) -> list[dict]:
    """The rows predicted further than ``bar`` from their published figure."""
    return [r for r in rows if abs(r["error"]) > bar]


def markdown(rows: list[dict]) -> str:
    """The comparison as a markdown table (with the mean absolute and the worst error)."""
    out = ["| run | embedding and head | layout (as run) | cluster | published TFLOP/s | "
           "predicted | error | bubble | TP comm | DP comm | PP comm |", "|" + "---|" * 11]
    for r in rows:
        tm = r["time"]
        share = {k: tm[k] / tm["total"] for k in ("tensor_comm", "data_comm_exposed",
                                                   "pipe_comm")}
        out.append(
            f"| {r['run']} | {r['placement']} | {r['layout']} | {r['cluster']} | "
            f"{r['published_tflops']:g} | "
            f"{r['predicted_tflops']:.1f} | {r['error']:+.1%} | {r['bubble_fraction']:.1%} | "
            f"{share['tensor_comm']:.1%} | {share['data_comm_exposed']:.1%} | "
            f"{share['pipe_comm']:.1%} |")
    mae = sum(abs(r["error"]) for r in rows) / len(rows)
    worst = max(rows, key=lambda r: abs(r["error"]))
    out += ["", f"Mean absolute error {mae:.1%}; worst {worst['run']} at {worst['error']:+.1%}; "
            f"{len(off(rows))} of {len(rows)} runs off by more than {BAR:.0%}."]
    return "\n".join(out)
