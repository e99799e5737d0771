"""A ResNet-50-shaped CNN pipelined over 4 stages by PipeDream's partitioner, against data
parallelism: exactness, stage balance, per-device memory and FLOPs as ratios.

The blocks are ResNet-50's bottlenecks ([3, 4, 6, 3], the first of each stage projecting and,
after the first stage, halving the image), at narrow widths on tiny images: 16 blocks that
differ in width, stride and shape. ``partition="cost"`` measures each block's compiled training
FLOPs (``cost_analysis``) and the dynamic program cuts 4 stages; the report gives each stage's
measured cost (on interleaved 1F1B, each stage's two chunks together), each layout's loss and
gradients against one device's ``jax.value_and_grad``, and the compiled step's per-device
memory (``memory_analysis``) on data=2 x pipe=4 (1F1B and interleaved) against data=8, and
the planner's price for each pipeline (``fiddlejax.planner.unequal``) beside it.
Writes benchmarks/results/hetero_pipeline.md.

    python benchmarks/hetero_pipeline.py
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax import planner  # noqa: E402
from fiddlejax.adaptation import grouping  # noqa: E402
from fiddlejax.pipeline.partition import chunk_costs, stage_loads  # noqa: E402
from fiddlejax.planner import unequal  # noqa: E402
from fiddlejax.planner.footprint import chunk_cost_scale  # noqa: E402

WIDTH, IMAGE, BATCH, CLASSES = 4, 16, 16, 10


class Bottleneck(nnx.Module):
    """ResNet's bottleneck: 1x1 down, 3x3 (strided where the stage starts), 1x1 up x4, a
    projection shortcut where the shape changes; GroupNorm in place of BatchNorm."""

    def __init__(self, cin: int, width: int, stride: int, rngs: nnx.Rngs):
        out = 4 * width
        self.c1 = nnx.Conv(cin, width, (1, 1), rngs=rngs)
        self.c2 = nnx.Conv(width, width, (3, 3), strides=stride, rngs=rngs)
        self.c3 = nnx.Conv(width, out, (1, 1), rngs=rngs)
        self.n1 = nnx.GroupNorm(width, num_groups=2, rngs=rngs)
        self.n2 = nnx.GroupNorm(width, num_groups=2, rngs=rngs)
        self.n3 = nnx.GroupNorm(out, num_groups=2, rngs=rngs)
        self.proj = (nnx.Conv(cin, out, (1, 1), strides=stride, rngs=rngs)
                     if stride != 1 or cin != out else None)

    def __call__(self, x):
        y = jax.nn.relu(self.n1(self.c1(x)))
        y = jax.nn.relu(self.n2(self.c2(y)))
        y = self.n3(self.c3(y))
        return jax.nn.relu(y + (x if self.proj is None else self.proj(x)))


class ResNet50ish(nnx.Module):
    def __init__(self, width: int = WIDTH, rngs: nnx.Rngs | None = None):
        self.stem = nnx.Conv(3, 4 * width, (3, 3), rngs=rngs)
        blocks, cin = [], 4 * width
        for stage, n in enumerate([3, 4, 6, 3]):
            w = width * 2 ** stage
            for i in range(n):
                blocks.append(Bottleneck(cin, w, 2 if stage and i == 0 else 1, rngs))
                cin = 4 * w
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, CLASSES, rngs=rngs)

    def __call__(self, images):
        x = self.stem(images)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(axis=(1, 2)))

    def batch_spec(self, b: int) -> dict:
        return {"images": jax.ShapeDtypeStruct((b, IMAGE, IMAGE, 3), jnp.float32),
                "labels": jax.ShapeDtypeStruct((b,), jnp.int32)}


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def leaf_errors(got, want, floor: float = 1e-4) -> list[float]:
    """Each leaf's ``||got - want|| / max(||want||, floor * ||want tree||)`` (as
    tests/helpers.py measures: a leaf tiny next to its tree is held to the tree's scale)."""
    a = [np.asarray(x, np.float64) for x in jax.tree.leaves(got)]
    b = [np.asarray(x, np.float64) for x in jax.tree.leaves(want)]
    total = np.sqrt(sum(np.sum(y * y) for y in b))
    return [float(np.linalg.norm(x - y) / max(np.linalg.norm(y), floor * total))
            for x, y in zip(a, b, strict=True)]


def most_even(costs: list[float], stages: int) -> tuple[float, list[int]]:
    """(slowest / fastest stage, blocks per stage) of the most even contiguous split, by
    trying every one: the bound any partitioner over whole blocks meets."""
    n, found = len(costs), []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
        stage = chunk_costs(counts, costs)
        found.append((max(stage) / min(stage), counts))
    return min(found)


def exactness(run, model, batch) -> tuple[float, float, int]:
    """(loss relative error, worst gradient leaf's, leaves) of ``run`` against one device."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    want = jax.jit(jax.value_and_grad(
        lambda p: ce(nnx.merge(graphdef, p, rest, copy=True)(batch["images"]), batch)))(params)
    loss, grads = run.loss_and_grads(run.init(), batch)
    loss_err = abs(float(loss) - float(want[0])) / abs(float(want[0]))
    return loss_err, max(leaf_errors(grads, want[1])), len(jax.tree.leaves(grads))


def run_stage_loads(run, costs: list[float]) -> tuple[list[list[int]], list[float]]:
    """Per pipeline stage: its chunks (the schedule's placement) and their summed FLOPs."""
    counts = [b - a for a, b in run.staged.groups]
    placement = run.pipeline.schedule.placement if run.pipeline else range(len(counts))
    held: dict[int, list[int]] = {}
    for c, st in enumerate(placement):
        held.setdefault(st, []).append(c)
    return [held[st] for st in sorted(held)], stage_loads(counts, costs, list(placement))


def stage_table(run, costs: list[float]) -> tuple[list[str], float]:
    """Rows of the stages a run's partitioner picked, and its slowest / fastest stage."""
    chunks, loads = run_stage_loads(run, costs)
    groups, mean = run.staged.groups, sum(costs) / len(loads)
    rows = ["| stage | chunks: blocks | measured FLOPs (one example) | / mean stage |",
            "|---|---|---|---|"]
    for st, (held, load) in enumerate(zip(chunks, loads)):
        spans = ", ".join(f"{groups[c][0]}..{groups[c][1] - 1}" for c in held)
        rows.append(f"| {st} | {spans} | {load:.0f} | {load / mean:.3f} |")
    return rows, max(loads) / min(loads)


def main() -> int:
    model = ResNet50ish(rngs=nnx.Rngs(0))
    batch = {"images": jax.random.normal(jax.random.key(1), (BATCH, IMAGE, IMAGE, 3)),
             "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, CLASSES)}
    mesh = fj.make_mesh(data=2, pipe=4, tensor=1)
    plans = {"1F1B": fj.Plan(mesh=mesh, schedule="1f1b", microbatches=4, partition="cost"),
             "interleaved 1F1B, 2 chunks a stage": fj.Plan(
                 mesh=mesh, schedule="interleaved-1f1b", virtual_stages=2, microbatches=4,
                 partition="cost"),
             "data=8": fj.Plan(mesh=fj.make_mesh(data=8, pipe=1, tensor=1))}
    runs = {k: fj.parallelize(model, optax.sgd(0.1), p, loss=ce, layers="blocks")
            for k, p in plans.items()}
    staged, canonical = fj.split_model(model, ce, layers="blocks")
    costs = [c["flops"] for c in grouping.block_costs(staged, canonical, model.batch_spec(1))]
    exact = {k: exactness(r, model, batch) for k, r in runs.items()}
    print("exactness", exact, flush=True)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    mem = {k: r.memory(batch=abstract) for k, r in runs.items()}
    print("memory", mem, flush=True)
    inputs = sum(a.size * a.dtype.itemsize for a in abstract.values()) / 2  # data=2's share
    priced = {k: priced_by_planner(runs[k], plans[k], model, canonical, mem[k], inputs)
              for k in list(runs)[:2]}
    print("planner", priced, flush=True)
    out = report(runs, costs, exact, mem) + planner_section(priced)
    path = Path(__file__).parent / "results" / "hetero_pipeline.md"
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0


def priced_by_planner(run, plan, model, canonical, compiled: dict, inputs: float) -> dict:
    """The planner's prediction for a pipeline (``planner.unequal.spec`` of its groups) beside
    the compiled step's figures (the batch's own bytes left out: the planner counts none)."""
    spec = unequal.spec(run.staged, canonical, model.batch_spec(1))
    # the runs' optimizer is optax.sgd: no optimizer state
    layout = dataclasses.replace(unequal.layout(plan, BATCH), optimizer="sgd")
    m = planner.predict(spec, planner.cluster("h100", nodes=1), layout).memory
    return {"state": (m.params + m.optimizer, compiled["argument_bytes"] - inputs),
            "peak": (m.total, compiled["peak_bytes"] - inputs),
            "slowest": chunk_cost_scale(spec, layout)}


def planner_section(priced: dict) -> list[str]:
    out = ["", "## The planner's price (`fiddlejax.planner.unequal.spec`)", "",
           "Per device, the planner's prediction for each pipeline's groups (the padded "
           "parameter rows, the largest group's residuals and boundary, each group's measured "
           "FLOPs) against the compiled step (less the batch's own bytes, which the planner "
           "does not count).", "",
           "| pipeline | parameters + optimizer: planner / compiled | peak: planner / compiled "
           "| slowest stage, in mean stages |", "|---|---|---|---|"]
    for name, got in priced.items():
        (ps, cs), (pp, cp) = got["state"], got["peak"]
        out.append(f"| {name} | {ps / 2**10:.0f} / {cs / 2**10:.0f} KiB ({ps / cs - 1:+.1%}) | "
                   f"{pp / 2**10:.0f} / {cp / 2**10:.0f} KiB ({pp / cp - 1:+.1%}) | "
                   f"{got['slowest']:.3f} |")
    return out


def report(runs: dict, costs: list[float], exact: dict, mem: dict) -> list[str]:
    plain, inter = list(runs)[:2]
    total = sum(costs)
    out = [
        "# A ResNet-50-shaped CNN over 4 pipeline stages (unequal blocks), against data "
        "parallelism", "",
        f"ResNet-50's 16 bottlenecks ([3, 4, 6, 3]) at width {WIDTH} (stage widths "
        f"{WIDTH}..{8 * WIDTH}, outputs {4 * WIDTH}..{32 * WIDTH} channels), {IMAGE}x{IMAGE} "
        f"images, global batch {BATCH}; GroupNorm. Pipelines: data=2 x pipe=4, 4 microbatches, "
        "`partition=\"cost\"` (PipeDream's dynamic program over each block's compiled training "
        "FLOPs on one example), on 1F1B (one chunk a stage) and on interleaved 1F1B (two "
        "chunks a stage, `virtual_stages=2`: the partitioner balances each stage's two chunks "
        "together, `partition.balanced(placement=)`). Data parallelism: data=8.", ""]
    for name in (plain, inter):
        rows, spread = stage_table(runs[name], costs)
        loads = run_stage_loads(runs[name], costs)[1]
        out += [f"## Stages the partitioner picked: {name}", "", *rows, "",
                f"Slowest / fastest stage: **{spread:.3f}** (target <= 1.15); slowest stage / "
                f"whole model {max(loads) / total:.3f} (ideal 0.25).", ""]
    spread, best = most_even(costs, 4)
    out += [f"Whole blocks over 4 stages of one chunk cannot come closer than {spread:.3f}: "
            f"the most even contiguous split of these {len(costs)} blocks (all "
            f"{math.comb(len(costs) - 1, 3)} tried) is {best} blocks per stage. With two chunks "
            "a stage, an uneven chunk pairs with one that evens it out. Each block's FLOPs: "
            f"{', '.join(f'{c / 1e6:.2f}M' for c in costs)} (the first block of each ResNet "
            "stage downsamples and widens).", "",
            "## Exactness (float32, against one device's jax.value_and_grad)", "",
            "| layout | loss rel. error | worst gradient leaf (of the leaves) |", "|---|---|---|"]
    for name, (loss_err, worst, leaves) in exact.items():
        out.append(f"| {name} | {loss_err:.1e} | {worst:.1e} (of {leaves}) |")
    out += ["", "Each leaf against max(its norm, 1e-4 x the gradient's), as tests/helpers.py; "
            "target < 1e-5.", "",
            "## Per-device memory of the compiled step (memory_analysis)", "",
            f"| | data=8 | {plain} | {inter} |", "|---|---|---|---|"]
    for key in ("argument_bytes", "temp_bytes", "peak_bytes"):
        a = mem["data=8"][key]
        cells = [f"{mem[n][key] / 2**10:.0f} KiB ({mem[n][key] / a:.2f}x)" for n in (plain, inter)]
        out.append(f"| {key} | {a / 2**10:.0f} KiB | {' | '.join(cells)} |")
    out += ["", "Arguments hold the parameters and the optimizer state: a pipeline stage holds "
            "its own blocks' (padded to the largest chunk's flat buffer), data parallelism "
            "every block's. The pipeline's temporaries hold its stash and transfer buffers."]
    return out


if __name__ == "__main__":
    sys.exit(main())
