"""What each modelled effect moves: the published runs re-predicted one change at a time.

Step 0 is the planner as it validated before (every Megatron row at microbatch 1, 1F1B, no
overlap, float32 gradients; BLOOM on the Selene preset with its layers split evenly; datasheet
NVLink and HBM bandwidths, asynchronous transfers, no accumulation pass). Each later step adds
one thing the runs did or one measured library efficiency, cumulatively, ending at the model
``fiddlejax plan validate`` uses. Run ``python -m fiddlejax.planner.attribution``.

The recent runs (``planner.recent``) the same way, per run: step 0 predicts the layout as
fiddlejax's runtime would run it (float32 master weights in the state, ``auto`` attention,
static expert buffers, no overlap, the head vocabulary-parallel, devices numbered
data-pipe-tensor), then each runtime knob of the run is added in turn. Each run keeps the
recomputation of its final layout throughout, so the steps show time only.
"""

from __future__ import annotations

import dataclasses

from fiddlejax.planner import published, recent
from fiddlejax.planner.cluster import ClusterSpec
from fiddlejax.planner.workload import gpt

STEPS = (
    "before (mb 1, 1F1B, Selene for BLOOM, datasheet bandwidths)",
    "+ each run's own settings (microbatch, interleaving, DDP, fp16 grads, tied embedding, "
    "rank order; BLOOM's cluster and partition)",
    "+ NCCL reaches 0.7 of A100 NVLink",
    "+ blocking stage-to-stage transfers, split over the tensor ranks",
    "+ a gradient-accumulation pass per microbatch",
    "+ elementwise kernels reach 0.9 of HBM",
)


def _variant(run: published.Run, step: int) -> published.Run:
    lo, name, m = run.layout, run.cluster, run.model
    if step < 1:
        megatron = run.source.startswith("Megatron")
        lo = dataclasses.replace(lo, virtual_stages=1, dp_overlap=0.0, grad_bytes=4,
                                 partition="layers", rank_order="data-pipe-tensor",
                                 microbatch_size=1 if megatron else lo.microbatch_size)
        name = "a100-80gb"
        if megatron:  # the old table's GPT had a head of its own
            m = gpt(m.num_layers, m.hidden, m.heads, m.seq_len, m.vocab, name=m.name)
    if step < 3:
        lo = dataclasses.replace(lo, p2p="async")
    if step < 4:
        lo = dataclasses.replace(lo, grad_accumulation="fused")
    return dataclasses.replace(run, layout=lo, cluster=name, model=m)


def _efficiencies(step: int):
    """The cluster as ``step`` sees it: measured efficiencies from steps 2 and 5 on."""

    def adjust(c: ClusterSpec) -> ClusterSpec:
        gpu = c.gpu if step >= 5 else dataclasses.replace(c.gpu, hbm_efficiency=1.0)
        return dataclasses.replace(c, gpu=gpu, nvlink_efficiency=(
            c.nvlink_efficiency if step >= 2 else 1.0))

    return adjust


def errors() -> list[tuple[str, list[float]]]:
    """Per step, the error of every run (``published.RUNS`` order)."""
    return [(label, [r["error"] for r in published.compare(
        tuple(_variant(r, step) for r in published.RUNS), _efficiencies(step))])
        for step, label in enumerate(STEPS)]


def markdown() -> str:
    """Steps as rows, runs as columns, with the mean absolute and the worst error."""
    names = [r.name.removeprefix("gpt-") for r in published.RUNS]
    lines = ["| step | " + " | ".join(names) + " | mean abs | worst |",
             "|" + "---|" * (len(names) + 3)]
    for label, errs in errors():
        worst = max(errs, key=abs)
        lines.append(f"| {label} | " + " | ".join(f"{e:+.1%}" for e in errs)
                     + f" | {sum(map(abs, errs)) / len(errs):.1%} | {worst:+.1%} |")
    return "\n".join(lines)


# (label, the Layout fields the step sets to the run's own values)
RECENT_STEPS = (
    ("fiddlejax's runtime", ()),
    ("+ distributed optimizer", ("master",)),
    ("+ fused attention", ("attention",)),
    ("+ dropless dispatch", ("dispatch",)),
    ("+ overlapped data comm (slowing the compute beneath it)", ("dp_overlap",)),
    ("+ head and rank order as run", ("head", "rank_order")),
)
_RUNTIME = dict(master="state", attention="auto", dispatch="static", dp_overlap=0.0,
                head="vocab-parallel", rank_order="data-pipe-tensor")


def recent_errors(runs=recent.RUNS) -> list[tuple[str, list[float]]]:
    """Per recent run, its error after each of ``RECENT_STEPS`` (cumulative)."""
    out = []
    for r in runs:
        kept = dict(_RUNTIME)
        errs = []
        for _, fields in RECENT_STEPS:
            for f in fields:
                kept.pop(f)
            lo = dataclasses.replace(r.layout, **kept)
            errs.append(recent.compare((dataclasses.replace(r, layout=lo),))[0]["error"])
        out.append((r.name, errs))
    return out


def recent_markdown() -> str:
    """Runs as rows, the cumulative steps as columns (the last is ``plan validate``'s)."""
    lines = ["| run | " + " | ".join(label for label, _ in RECENT_STEPS) + " |",
             "|" + "---|" * (len(RECENT_STEPS) + 1)]
    for name, errs in recent_errors():
        lines.append(f"| {name} | " + " | ".join(f"{e:+.1%}" for e in errs) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
    print()
    print(recent_markdown())
