"""``fiddlejax plan``: predict one layout, search all layouts, or validate against publications.

    fiddlejax plan predict --model gpt3-175b --cluster h100 --nodes 64 --tensor 8 --pipe 8 \\
        --microbatch-size 1 --global-batch 1536 --schedule 1f1b --remat full [--json]
    fiddlejax plan predict ... --pipe 8 --schedule 2bw --steps-per-call 4   # PipeDream-2BW
    fiddlejax plan search --model gpt3-175b --cluster h100 --nodes 64 --global-batch 1536 \\
        [--top 10] [--schedules 1f1b zb-h1 2bw --steps-per-call 4] [--json]
    fiddlejax plan predict ... --matmul-dtype fp8           # fp8 matmuls (H100/H200)
    fiddlejax plan validate [--json]       # every published run: predicted vs published;
                                           # exit 1 when one is off by more than 15%;
                                           # then the 2024-26 runs (reported, not gated)
    fiddlejax plan predict --model bloom-176b --cluster jean-zay-a100 --nodes 48 --tensor 4 \
        --pipe 12 --microbatch-size 2 --global-batch 2048 --remat full --zero 1 \
        --head last-stage --partition layers+head --p2p blocking --grad-accumulation cast-add \
        --rank-order pipe-data-tensor   # BLOOM-176B as it ran
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fiddlejax.planner import families, hf_config, workload
from fiddlejax.planner.attention import ATTENTIONS
from fiddlejax.planner.attention import kind as attention_kind
from fiddlejax.planner.cluster import PRESETS as CLUSTERS
from fiddlejax.planner.cluster import cluster
from fiddlejax.planner.predict import Prediction, predict
from fiddlejax.planner.search import DEFAULT_SCHEDULES, search
from fiddlejax.planner.space import (
    DISPATCHES,
    FSDP_GATHERS,
    GRAD_ACCUMULATIONS,
    HEADS,
    MASTERS,
    MATMUL_DTYPES,
    P2PS,
    PARTITIONS,
    PRECISIONS,
    RANK_ORDERS,
    ZEROS,
    Layout,
    schedule_kinds,
)

GIB = 2**30


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    presets = ", ".join(families.names())
    g.add_argument("--model", default="gpt",
                   help=f"'gpt' or 'llama' (with the flags below), a preset: {presets}; "
                        "or a Hugging Face checkpoint directory (or its config.json) of a "
                        "family models.from_pretrained imports")
    for f in ("layers", "hidden", "heads", "kv-heads", "seq", "vocab", "ffn"):
        g.add_argument(f"--{f}", type=int)
    g.add_argument("--tied", action="store_true",
                   help="gpt/llama: the head multiplies by the embedding (no matrix of its own)")
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", default="h100", choices=sorted(CLUSTERS))
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--global-batch", type=int, required=True, help="samples per step")
    c.add_argument("--precision", choices=PRECISIONS,
                   help="default: bf16-mixed on GPUs, fp32 on cpu-sim")
    c.add_argument("--matmul-dtype", choices=[d for d in MATMUL_DTYPES if d],
                   help="fp8: each layer's dense matmuls in float8 (fj.Plan(matmul_dtype="
                   "'fp8'), job key plan.matmul_dtype=fp8); needs a GPU with fp8 (h100, h200)")
    c.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="fused: cuDNN's flash attention (no s x s scores in memory); xla: "
                   "XLA's (keeps them, what the CPU compiles); auto (default): fused in "
                   "bf16-mixed on a GPU, else xla")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _model(a: argparse.Namespace) -> workload.ModelSpec:
    if a.model not in families.names() and ("/" in a.model or a.model.endswith(".json")
                                            or os.path.isdir(a.model)):
        return hf_config.load(a.model, seq=a.seq)  # a Hugging Face checkpoint's config.json
    if a.model not in ("gpt", "llama"):
        return families.preset(a.model, seq=a.seq)
    need = ("layers", "hidden", "heads", "seq", "vocab") + (
        ("kv_heads", "ffn") if a.model == "llama" else ())
    missing = [f"--{f.replace('_', '-')}" for f in need if getattr(a, f) is None]
    if missing:
        raise ValueError(f"--model {a.model} needs {' '.join(missing)} (or a preset such as "
                         "--model gpt3-175b or --model llama3-8b)")
    if a.model == "llama":
        return workload.llama(a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.seq, a.vocab,
                              tied=a.tied)
    return workload.gpt(a.layers, a.hidden, a.heads, a.seq, a.vocab, ffn=a.ffn, tied=a.tied)


def _precision(a: argparse.Namespace) -> str:
    """The job's default: bf16 on GPUs and with fp8 matmuls (``plan.compute_dtype=auto``)."""
    if a.precision:
        return a.precision
    return "fp32" if a.cluster == "cpu-sim" and not a.matmul_dtype else "bf16-mixed"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fiddlejax plan", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("predict", help="predict one layout's step time and memory")
    _common(pp)
    pp.add_argument("--tensor", type=int, default=1)
    pp.add_argument("--pipe", type=int, default=1)
    pp.add_argument("--expert", type=int, default=1,
                    help="MoE models: experts split over it, the batch too (outside them)")
    pp.add_argument("--context", type=int, default=1,
                    help="devices each sequence is split over (the context ring)")
    pp.add_argument("--sequence-parallel", action="store_true",
                    help="the replicated activations split over tensor too")
    pp.add_argument("--data", type=int,
                    help="default: GPUs / (tensor x pipe x context x expert)")
    pp.add_argument("--virtual-stages", type=int, default=1)
    pp.add_argument("--microbatch-size", type=int, default=1)
    pp.add_argument("--schedule", choices=schedule_kinds())
    pp.add_argument("--steps-per-call", type=int, default=1,
                    help="2bw: optimizer steps per call without a pipeline flush (K)")
    pp.add_argument("--remat", default="none", choices=workload.POLICIES)
    pp.add_argument("--zero", type=int, default=0, choices=ZEROS,
                    help="1: optimizer state sharded over data; 3: FSDP")
    pp.add_argument("--fsdp-gather", default="layer", choices=FSDP_GATHERS,
                    help="zero=3: gather each layer's weights per use (layer) or a stage's "
                    "once per step (step)")
    pp.add_argument("--head", default="vocab-parallel", choices=HEADS,
                    help="pipelines: embedding and head vocabulary-parallel on every stage "
                    "(fiddlejax) or on the first and last stage (Megatron-LM, to compare with "
                    "its published runs)")
    pp.add_argument("--dp-overlap", type=float, default=0.0,
                    help="share of the gradient all-reduce hidden under the backward")
    g = pp.add_argument_group("how a published run executed (defaults: fiddlejax)")
    g.add_argument("--p2p", default="async", choices=P2PS,
                   help="stage-to-stage transfers: async, batched (Megatron-LM 2021) or "
                   "blocking (DeepSpeed's pipeline engine)")
    g.add_argument("--grad-accumulation", default="fused", choices=GRAD_ACCUMULATIONS,
                   help="separate: an HBM pass per microbatch adding its gradient; cast-add: "
                   "a cast to the accumulator's dtype first (DeepSpeed's BF16_Optimizer)")
    g.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4),
                   help="bytes per gradient element reduced over data (2: fp16)")
    g.add_argument("--rank-order", default="data-pipe-tensor", choices=RANK_ORDERS,
                   help="device numbering, outermost axis first (Megatron-LM and DeepSpeed: "
                   "pipe-data-tensor)")
    g.add_argument("--master", default="state", choices=MASTERS,
                   help="optimizer: Megatron-Core's distributed optimizer (bf16 weights, "
                   "float32 master and moments in the optimizer state)")
    g.add_argument("--dispatch", default="static", choices=DISPATCHES,
                   help="MoE: dropless sends only the real token-expert pairs (Megatron-Core, "
                   "DeepEP)")
    g.add_argument("--partition", default="layers", choices=PARTITIONS,
                   help="layers+head: the embedding and head count as a layer each "
                   "(Megatron-DeepSpeed's type:transformer|embedding)")
    ps = sub.add_parser("search", help="rank every layout that fits memory")
    _common(ps)
    ps.add_argument("--top", type=int, default=10)
    ps.add_argument("--remat", nargs="+", default=["none", "full"], choices=workload.POLICIES)
    ps.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES),
                    choices=schedule_kinds(), help="pipeline schedules to consider (2bw only when "
                    "named: its updates use one-step-stale gradients)")
    ps.add_argument("--steps-per-call", type=int, default=1,
                    help="2bw: optimizer steps per call without a pipeline flush (K)")
    pv = sub.add_parser("validate", help="every published run (Megatron-LM 2021 Table 1, "
                        "BLOOM-176B) predicted as it ran vs its published throughput")
    pv.add_argument("--json", action="store_true")
    return ap


def _row(pr: Prediction) -> dict:
    return pr.to_dict()


def _print_predict(pr: Prediction) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    lo, tm, mem = pr.layout, pr.time, pr.memory
    con.print(f"[bold]{pr.model.name}[/] ({pr.model.params / 1e9:.2f}B params) on "
              f"{pr.cluster.describe()}")
    con.print(f"layout: {lo.short()}  microbatches={lo.microbatches}  "
              f"global_batch={lo.global_batch}  precision={lo.precision}  "
              f"attention={attention_kind(pr.model, lo, pr.cluster)}"
              + ("  matmuls=fp8 (dense; attention, embedding and head bf16)"
                 if lo.matmul_dtype == "fp8" else ""))
    if lo.pipe > 1:
        con.print("embedding and head: " + (
            "first and last stage (Megatron-LM's placement)" if lo.head == "last-stage"
            else "vocabulary-parallel on every stage (fiddlejax's placement)"))
    per = (f" (per optimizer step; {lo.steps_per_call} per call, one-step-stale gradients)"
           if lo.kind == "2bw" else "")
    t = Table(title="step time" + per)
    for c in ("part", "seconds", "share"):
        t.add_column(c, justify="right" if c != "part" else "left")
    for name, v in (("compute", tm.compute), ("tensor-parallel comm", tm.tensor_comm),
                    ("pipeline bubble", tm.bubble), ("data-parallel comm (exposed)",
                                                     tm.data_comm_exposed),
                    ("data-parallel comm (overlapped)", tm.overlapped),
                    ("pipeline transfers (blocking)", tm.pipe_comm),
                    ("compute slowed by hidden comm", tm.contention),
                    ("optimizer", tm.optimizer), ("step", tm.total)):
        share = "" if name.endswith("(overlapped)") else f"{v / tm.total:.1%}"
        t.add_row(name, f"{v:.4f}", share)
    con.print(t)
    m = Table(title="memory per GPU")
    m.add_column("part")
    m.add_column("GiB", justify="right")
    for name, v in (("parameters", mem.params), ("gradients", mem.grads),
                    ("optimizer state", mem.optimizer), ("activations (stash)", mem.activations),
                    ("working set", mem.working), ("total", mem.total),
                    ("budget", pr.cluster.memory_budget)):
        m.add_row(name, f"{v / GIB:.2f}")
    con.print(m)
    con.print(f"tokens/s {pr.tokens_per_second:,.0f}   model TFLOP/s per GPU "
              f"{pr.model_tflops_per_gpu:.1f}   hardware TFLOP/s per GPU "
              f"{pr.hardware_tflops_per_gpu:.1f}   MFU {pr.mfu:.1%}   bubble "
              f"{pr.bubble_fraction:.1%}   fits: {'yes' if pr.fits else '[red]NO[/]'}")


def _print_search(model, clus, ranked: list[Prediction]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 150))
    con.print(f"[bold]{model.name}[/] ({model.params / 1e9:.2f}B params) on {clus.describe()}")
    fp8 = " (fp8 matmuls)" if ranked and ranked[0].layout.matmul_dtype == "fp8" else ""
    t = Table(title=f"best {len(ranked)} layouts that fit{fp8}")
    for c in ("#", "layout", "m", "step s", "tokens/s", "TFLOP/s/GPU", "MFU", "bubble",
              "memory GiB"):
        t.add_column(c, justify="left" if c == "layout" else "right", no_wrap=True)
    for i, pr in enumerate(ranked, 1):
        t.add_row(str(i), pr.layout.short(), str(pr.layout.microbatches),
                  f"{pr.time.total:.3f}", f"{pr.tokens_per_second:,.0f}",
                  f"{pr.model_tflops_per_gpu:.1f}", f"{pr.mfu:.1%}",
                  f"{pr.bubble_fraction:.1%}", f"{pr.memory.total / GIB:.1f}")
    con.print(t)


def plan_command(argv: list[str]) -> int:
    """Entry point of ``fiddlejax plan``; returns the exit status."""
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        if a.cmd == "validate":
            from fiddlejax.planner import published, recent

            rows, new = published.compare(), recent.compare()
            print(json.dumps(rows + new, indent=2) if a.json else published.markdown(rows)
                  + "\n\nRecent runs (2024-26, tokens/s per GPU; reported, not gated):\n\n"
                  + recent.markdown(new))
            bad = published.off(rows)
            if bad:
                names = ", ".join(f"{r['run']} {r['error']:+.1%}" for r in bad)
                print(f"fiddlejax plan validate: {len(bad)} run(s) off by more than "
                      f"{published.BAR:.0%}: {names}", file=sys.stderr)
                return 1
            return 0
        model = _model(a)
        clus = cluster(a.cluster, nodes=a.nodes, gpus_per_node=a.gpus_per_node)
        if a.cmd == "predict":
            tp = a.tensor * a.pipe * a.expert * a.context
            data = a.data
            if data is None:
                if clus.num_gpus % tp:
                    raise ValueError(f"tensor x pipe x context x expert = {tp} does not divide the "
                                     f"cluster's "
                                     f"{clus.num_gpus} GPUs; pick sizes that divide it")
                data = clus.num_gpus // tp
            lo = Layout(tensor=a.tensor, pipe=a.pipe, data=data, expert=a.expert,
                        context=a.context, sequence_parallel=a.sequence_parallel,
                        master=a.master, dispatch=a.dispatch,
                        virtual_stages=a.virtual_stages, microbatch_size=a.microbatch_size,
                        global_batch=a.global_batch, schedule=a.schedule,
                        steps_per_call=a.steps_per_call, remat=a.remat, zero=a.zero,
                        precision=_precision(a), head=a.head, dp_overlap=a.dp_overlap,
                        fsdp_gather=a.fsdp_gather, p2p=a.p2p, grad_bytes=a.grad_bytes,
                        grad_accumulation=a.grad_accumulation, partition=a.partition,
                        rank_order=a.rank_order, matmul_dtype=a.matmul_dtype,
                        attention=a.attention)
            pr = predict(model, clus, lo)
            if a.json:
                print(json.dumps(_row(pr), indent=2))
            else:
                _print_predict(pr)
            return 0
        if a.top < 1:
            raise ValueError(f"--top {a.top} must be >= 1")
        ranked = search(model, clus, a.global_batch, top=a.top, remats=tuple(a.remat),
                        schedules=tuple(a.schedules), steps_per_call=a.steps_per_call,
                        precision=_precision(a), matmul_dtype=a.matmul_dtype,
                        attention=a.attention)
        if a.json:
            print(json.dumps({"model": model.name, "cluster": clus.name, "gpus": clus.num_gpus,
                              "layouts": [_row(p) for p in ranked]}, indent=2))
        else:
            _print_search(model, clus, ranked)
        return 0
    except ValueError as e:
        print(f"fiddlejax plan {a.cmd}: error: {e}", file=sys.stderr)
        return 2
