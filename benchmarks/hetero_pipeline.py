"""A ResNet-50-shaped CNN pipelined over 4 stages by PipeDream's partitioner, against data
parallelism: exactness, stage balance, per-device memory and FLOPs as ratios.

The blocks are ResNet-50's bottlenecks ([3, 4, 6, 3], the first of each stage projecting and,
after the first stage, halving the image), at narrow widths on tiny images: 16 blocks that
differ in width, stride and shape. ``partition="cost"`` measures each block's compiled training
FLOPs (``cost_analysis``) and the dynamic program cuts 4 stages; the report gives each stage's
measured cost, the pipeline's loss and gradients against one device's ``jax.value_and_grad``,
and the compiled step's per-device memory (``memory_analysis``) on data=2 x pipe=4 (1F1B)
against data=8. Writes benchmarks/results/hetero_pipeline.md.

    python benchmarks/hetero_pipeline.py
"""

from __future__ import annotations

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
from fiddlejax.adaptation import grouping  # noqa: E402
from fiddlejax.pipeline.partition import chunk_costs  # noqa: E402

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


def main() -> int:
    model = ResNet50ish(rngs=nnx.Rngs(0))
    batch = {"images": jax.random.normal(jax.random.key(1), (BATCH, IMAGE, IMAGE, 3)),
             "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, CLASSES)}
    pipe_plan = fj.Plan(mesh=fj.make_mesh(data=2, pipe=4, tensor=1), schedule="1f1b",
                        microbatches=4, partition="cost")
    dp_plan = fj.Plan(mesh=fj.make_mesh(data=8, pipe=1, tensor=1))
    pipe = fj.parallelize(model, optax.sgd(0.1), pipe_plan, loss=ce, layers="blocks")
    groups = pipe.staged.groups
    counts = [b - a for a, b in groups]
    staged, canonical = fj.split_model(model, ce, layers="blocks")
    costs = [c["flops"] for c in grouping.block_costs(staged, canonical, model.batch_spec(1))]
    stage = chunk_costs(counts, costs)
    print("blocks per stage", counts, "stage FLOPs", stage, flush=True)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    want = jax.jit(jax.value_and_grad(
        lambda p: ce(nnx.merge(graphdef, p, rest, copy=True)(batch["images"]), batch)))(params)
    loss, grads = pipe.loss_and_grads(pipe.init(), batch)
    loss_err = abs(float(loss) - float(want[0])) / abs(float(want[0]))
    worst = max(leaf_errors(grads, want[1]))
    print(f"loss rel {loss_err:.2e}, worst gradient leaf rel {worst:.2e}", flush=True)

    dp = fj.parallelize(model, optax.sgd(0.1), dp_plan, loss=ce, layers="blocks")
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    mem_dp = dp.memory(batch=abstract)
    print("data", mem_dp, flush=True)
    mem_pipe = pipe.memory(batch=abstract)
    print("pipe", mem_pipe, flush=True)

    total = sum(costs)
    out = [
        "# A ResNet-50-shaped CNN over 4 pipeline stages (unequal blocks), against data "
        "parallelism", "",
        f"ResNet-50's 16 bottlenecks ([3, 4, 6, 3]) at width {WIDTH} (stage widths "
        f"{WIDTH}..{8 * WIDTH}, outputs {4 * WIDTH}..{32 * WIDTH} channels), {IMAGE}x{IMAGE} "
        f"images, global batch {BATCH}; GroupNorm. Pipeline: data=2 x pipe=4, 1F1B, 4 "
        "microbatches, `partition=\"cost\"` (PipeDream's dynamic program over each block's "
        "compiled training FLOPs on one example). Data parallelism: data=8.", "",
        "## Stages the partitioner picked", "",
        "| stage | blocks | measured FLOPs (one example) | / mean stage |", "|---|---|---|---|"]
    mean = total / len(stage)
    for s, ((a, b), f) in enumerate(zip(groups, stage)):
        out.append(f"| {s} | {a}..{b - 1} | {f:.0f} | {f / mean:.3f} |")
    spread, best = most_even(costs, len(stage))
    out += ["", f"Slowest / fastest stage: **{max(stage) / min(stage):.3f}** (target <= 1.15); "
            f"slowest / mean stage {max(stage) / mean:.3f}; slowest stage / whole model: "
            f"{max(stage) / total:.3f} (ideal 0.25).", "",
            f"The most even contiguous split of these {len(costs)} blocks (all "
            f"{math.comb(len(costs) - 1, len(stage) - 1)} tried): {best} blocks per stage, "
            f"slowest / fastest {spread:.3f}; whole blocks cannot come closer. Each block's "
            f"FLOPs: {', '.join(f'{c / 1e6:.2f}M' for c in costs)} (the first block of each "
            "ResNet stage downsamples and widens).", "",
            "## Exactness (float32, against one device's jax.value_and_grad)", "",
            f"Loss relative error {loss_err:.1e}; worst gradient leaf {worst:.1e} "
            f"(of {len(jax.tree.leaves(grads))} leaves, each against max(its norm, 1e-4 x the "
            "gradient's), as tests/helpers.py; target < 1e-5).", "",
            "## Per-device memory of the compiled step (memory_analysis)", "",
            "| | data=8 | data=2 x pipe=4 | pipe / data |", "|---|---|---|---|"]
    for key in ("argument_bytes", "temp_bytes", "peak_bytes"):
        a, b = mem_dp[key], mem_pipe[key]
        out.append(f"| {key} | {a / 2**10:.0f} KiB | {b / 2**10:.0f} KiB | {b / a:.2f}x |")
    out += ["", "Arguments hold the parameters and the optimizer state: a pipeline stage holds "
            "its own blocks' (padded to the largest stage's flat buffer), data parallelism "
            "every block's. The pipeline's temporaries hold its stash and transfer buffers."]
    path = Path(__file__).parent / "results" / "hetero_pipeline.md"
    reporting.write(path, "\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
