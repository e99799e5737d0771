"""All-reduce algorithms: predicted time on every topology preset, Blink's fragmented DGX-1 case,
and the bytes each schedule sends, counted in the HLO that XLA compiles.

Predictions come from `fiddlejax.collectives.cost` (alpha-beta replay of each algorithm's actual
message schedule on the topology's links); bytes come from compiling the schedules on 8 simulated
CPU devices. Writes `benchmarks/results/collectives.md` and
`benchmarks/results/collectives_time_vs_size.png`.

    python benchmarks/collectives.py            # about 2 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import reporting  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fiddlejax.collectives import algorithms, cost, trees  # noqa: E402
from fiddlejax.collectives import topology as T  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB, GiB = 2**10, 2**20, 2**30
TABLE_SIZES = [4 * KiB, 256 * KiB, 16 * MiB, 256 * MiB, GiB]
PLOT_SIZES = [2**e for e in range(10, 31)]
SHORT = {
    "xla": "xla",
    "ring": "ring",
    "bidirectional-ring": "bidi-ring",
    "recursive-halving-doubling": "rhd",
    "tree": "tree",
    "hierarchical": "hier",
    "packed-trees": "packed",
}


def fmt_time(s: float) -> str:
    return f"{s * 1e6:,.1f}" if s < 1e-3 else f"{s * 1e6:,.0f}"


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def topology_table(presets: dict[str, T.Topology]) -> list[str]:
    rows = [
        "| preset | devices | tree links | packing rate (GB/s) | max-flow bound (GB/s) | "
        "trees | max height | best ring order (axis indices) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, topo in presets.items():
        pk = trees.pack_trees(topo)
        links = "direct (NVLink)" if trees.direct_only(topo) else "all routes"
        order = cost.best_ring_order(topo) if topo.size <= 9 else "-"
        rows.append(
            f"| {name} | {topo.size} | {links} | {pk.rate / 1e9:.1f} | {pk.bound / 1e9:.1f} | "
            f"{len(pk.trees)} | {pk.height} | {order} |"
        )
    return rows


def prediction_table(topo: T.Topology) -> list[str]:
    names = list(cost.predict_all(topo, 1024))
    head = "| size | " + " | ".join(SHORT[a] for a in names) + " | bound | auto |"
    rows = [head, "|---" * (len(names) + 3) + "|"]
    for n in TABLE_SIZES:
        pred = cost.predict_all(topo, n)
        best = min(pred, key=pred.get)
        cells = [f"**{fmt_time(pred[a])}**" if a == best else fmt_time(pred[a]) for a in names]
        auto = algorithms.choose_algorithm(
            topo.size, n, topology=topo, inner=(T.hierarchy_shape(topo) or (0, None))[1]
        )
        bound = trees.allreduce_bound(topo, n)
        rows.append(f"| {fmt_size(n)} | " + " | ".join(cells) + f" | {fmt_time(bound)} | "
                    f"{SHORT[auto]} |")  # fmt: skip
    return rows


def fragment_section() -> tuple[list[str], dict]:
    frag = T.dgx1_v100_fragment()
    best = T.subset(frag, cost.best_ring_order(frag))
    hybrid = trees.pack_trees(frag, direct=False)
    rows = [
        "| size | ring (device order) | ring (best NVLink order) | bidi-ring (best order) | "
        "packed trees | max-flow bound | trees / ring | trees / bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    facts = {}
    for n in (64 * MiB, 256 * MiB, GiB, 4 * GiB):
        ring = cost.predict("ring", frag, n)
        ring_best = cost.predict("ring", best, n)
        bidi_best = cost.predict("bidirectional-ring", best, n)
        pk = cost.predict("packed-trees", frag, n)
        bound = trees.allreduce_bound(frag, n)
        facts[n] = (pk / ring, pk / bound, pk / ring_best)
        rows.append(
            f"| {fmt_size(n)} | {fmt_time(ring)} | {fmt_time(ring_best)} | {fmt_time(bidi_best)} | "
            f"{fmt_time(pk)} | {fmt_time(bound)} | {pk / ring:.3f} | {pk / bound:.3f} |"
        )
    vs_ring, vs_bound, vs_best = facts[GiB]
    rows += ["", f"At 1 GiB the packed trees are {1 / vs_best:.1f}x faster than the best "
             f"NVLink-ordered ring ({1 / vs_ring:.1f}x the ring in device order) and within "
             f"{vs_bound - 1:.1%} of the max-flow bound."]
    pk = trees.pack_trees(frag)
    rows += [
        "",
        f"Trees (root GPU{frag.devices[pk.root][3:]}, parent of each of GPUs "
        f"{', '.join(d[3:] for d in frag.devices)}; share of the data):",
        "",
    ]
    for t, w in zip(pk.trees, pk.weights, strict=True):
        par = ", ".join("root" if u < 0 else frag.devices[u][3:] for u in t)
        rows.append(f"- ({par}): {w:.3f}")
    rows += [
        "",
        f"With PCIe routes too (`pack_trees(topo, direct=False)`): {hybrid.rate / 1e9:.1f} GB/s "
        f"against a {hybrid.bound / 1e9:.1f} GB/s max-flow bound ({len(hybrid.trees)} trees); "
        "PCIe switches and QPI cannot replicate data, so route-based trees stop short of the cut.",
    ]
    return rows, facts


def hlo_bytes_table() -> list[str]:
    rows = [
        "| algorithm | p | bytes sent / n (max device) | 2(p-1)/p | collective ops | op kinds |",
        "|---|---|---|---|---|---|",
    ]
    n = 3 * 2**12  # float32 elements per device, divisible by every p used
    cases = [(a, 8) for a in ("xla", "ring", "bidirectional-ring", "recursive-halving-doubling",
                              "tree", "packed-trees")]  # fmt: skip
    cases += [(a, 6) for a in ("ring", "bidirectional-ring", "recursive-halving-doubling")]
    for alg, p in cases + [("hierarchical", 8)]:
        if alg == "hierarchical":
            mesh = jax.make_mesh((2, 4), ("node", "gpu"), axis_types=(AxisType.Auto,) * 2)
            axes, spec = ("node", "gpu"), P(("node", "gpu"))
        else:
            mesh = jax.make_mesh(
                (p,), ("i",), devices=jax.devices()[:p], axis_types=(AxisType.Auto,)
            )
            axes, spec = "i", P("i")
        topo = T.dgx1_v100() if p == 8 else None
        f = jax.shard_map(
            lambda v, alg=alg, axes=axes, topo=topo: algorithms.allreduce(
                v, axes, alg, topology=topo if alg == "packed-trees" else None
            ),
            mesh=mesh, in_specs=spec, out_specs=P(),
        )  # fmt: skip
        text = jax.jit(f).lower(np.ones(p * n, np.float32)).compile().as_text()
        sent = cost.bytes_sent_per_device(text)
        ops = cost.hlo_collectives(text)
        kinds = ", ".join(sorted({o.kind for o in ops}))
        label = "hierarchical (2 x 4)" if alg == "hierarchical" else alg
        rows.append(
            f"| {label} | {p} | {max(sent.values()) / (4 * n):.4f} | {2 * (p - 1) / p:.4f} | "
            f"{len(ops)} | {kinds} |"
        )
    return rows


def plot(presets: dict[str, T.Topology], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["dgx1-v100", "dgx1-v100-fragment", "dgx-h100", "2x8-nodes"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True)
    for ax, name in zip(axes.flat, names, strict=True):
        topo = presets[name]
        algs = list(cost.predict_all(topo, 1024))
        for a in algs:  # xla overlaps ring or tree, bidi-ring overlaps ring on some presets
            ys = [cost.predict(a, topo, n) for n in PLOT_SIZES]
            style = {"xla": ":", "bidirectional-ring": "--"}.get(a, "-")
            ax.loglog(PLOT_SIZES, ys, style, label=a, linewidth=2.5 if a == "packed-trees" else 1.4)
        if topo.size <= 9:
            best = T.subset(topo, cost.best_ring_order(topo))
            ys = [cost.predict("ring", best, n) for n in PLOT_SIZES]
            ax.loglog(PLOT_SIZES, ys, "-.", color="gray", label="ring, best NVLink order")
        ax.loglog(PLOT_SIZES, [trees.allreduce_bound(topo, n) for n in PLOT_SIZES], "k--",
                  label="max-flow bound (trees, bandwidth only)", linewidth=1)  # fmt: skip
        ax.set_ylim(bottom=1e-6)
        ax.set_title(topo.name)
        ax.set_xlabel("message size per device (bytes)")
        ax.set_ylabel("predicted all-reduce time (s)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Predicted all-reduce time vs message size (alpha-beta model, cost.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    t0 = time.time()
    RESULTS.mkdir(parents=True, exist_ok=True)
    presets = {name: T.preset(name) for name in T.PRESETS}
    out = [
        "# Collectives: predicted all-reduce times and measured bytes",
        "",
        "Times are predictions of the alpha-beta "
        "model in `fiddlejax/collectives/cost.py` (microseconds, per-device message size; bold: "
        "fastest); bytes are counted in HLO compiled for 8 simulated CPU devices.",
        "",
        "## Topologies and tree packings",
        "",
        *topology_table(presets),
        "",
        "## Blink's fragmented DGX-1 (GPUs 0, 1, 2, 4, 5, 6)",
        "",
    ]
    frag_rows, facts = fragment_section()
    out += frag_rows
    out += ["", "## Predicted time (us) by preset", ""]
    for name, topo in presets.items():
        out += [f"### {name}: {topo.name}", "", *prediction_table(topo), ""]
    out += ["## Bytes sent per device, counted in compiled HLO", "", *hlo_bytes_table(), ""]
    out += [
        "xla's psum is one `all-reduce`, credited with the bandwidth-optimal 2(p-1)/p n. The tree "
        "rows are the busiest device: the binomial root sends n to each of its log2 p children; "
        "with packed trees a device sends its share of every tree up once and down once per "
        "child, about 2n in all, spread over more links than a ring uses. Non-power-of-two "
        "halving-doubling: the folded-in ranks add n each way (2.5 n at p = 6).",
        "",
        "![predicted time vs size](collectives_time_vs_size.png)",
        "",
        f"_Run time: {time.time() - t0:.0f} s._",
    ]
    plot(presets, RESULTS / "collectives_time_vs_size.png")
    reporting.write((RESULTS / "collectives.md"), "\n".join(out) + "\n")
    for n, (vs_ring, vs_bound, vs_best) in facts.items():
        print(f"fragment {fmt_size(n)}: trees/ring {vs_ring:.3f}  trees/bound {vs_bound:.3f}  "
              f"trees/best-order ring {vs_best:.3f}")  # fmt: skip
    print(f"wrote {RESULTS / 'collectives.md'} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
