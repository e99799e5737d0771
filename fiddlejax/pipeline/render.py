"""Pictures of pipeline schedules: a text timeline, a PNG, and the ``fiddlejax schedule`` command.

Everything here reads a ``Schedule`` and its simulated timeline; nothing here changes what a
schedule means. matplotlib is imported only when a PNG is asked for.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fiddlejax.pipeline import schedules
from fiddlejax.pipeline.schedules import Action, Schedule

__all__ = ["label", "text_timeline", "tick_text", "summary", "render_png", "schedule_command"]

# Colour-blind-safe-ish: forwards blue, whole backwards green, split backward I teal, W orange.
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#64B5CD", "W": "#DD8452"}


def label(action: Action, schedule: Schedule) -> str:
    """``F3`` for microbatch 3; ``F3:5`` (chunk 5) when stages hold several chunks."""
    base = f"{action.op}{action.microbatch}"
    return f"{base}:{action.chunk}" if schedule.num_chunks > schedule.stages else base


def text_timeline(
    schedule: Schedule,
    costs: Mapping[str, float] | None = None,
    latency: float = 0.0,
    unit: float = 1.0,
) -> str:
    """One row per stage, one column per ``unit`` of simulated time; ``.`` marks idle time.

    An action spans as many columns as it lasts, so with F=1 and B=2 a B is twice as wide.
    Times are rounded to whole units, so pick ``unit`` to divide the costs.
    """
    sim = schedules.simulate(schedule, costs, latency)
    width = 1 + max((len(label(a, schedule)) for row in schedule.actions for a in row), default=1)
    columns = round(sim.makespan / unit)
    head = f"{'time':>8} " + "".join(
        f"{t * unit:<{width}g}" if t % 5 == 0 else " " * width for t in range(columns)
    )
    lines = [head.rstrip()]
    for st, row in enumerate(schedule.actions):
        cells = ""
        for a, span in zip(row, sim.spans[st], strict=True):
            start, end = round(span.start / unit), round(span.end / unit)
            if end <= start:  # shorter than half a unit: too small to draw
                continue
            cells += "." * (start * width - len(cells))
            room = (end - start) * width - 1
            cells += label(a, schedule).ljust(room)[:room] + "|"
        cells += "." * (columns * width - len(cells))
        lines.append(f"stage {st:>2} {cells}")
    return "\n".join(lines)


def tick_text(schedule: Schedule) -> str:
    """The lockstep tick table the runtime executes: stages as rows, ticks as columns."""
    table = schedule.ticks
    width = 1 + max((len(label(a, schedule)) for row in schedule.actions for a in row), default=1)
    head = f"{'tick':>8} " + "".join(
        f"{t:<{width}}" if t % 5 == 0 else " " * width for t in range(table.num_ticks)
    )
    lines = [head.rstrip()]
    for st in range(schedule.stages):
        cells = "".join(
            (label(row[st], schedule) if row[st] else ".").ljust(width) for row in table.ticks
        )
        lines.append(f"stage {st:>2} {cells.rstrip()}")
    return "\n".join(lines)


def summary(
    schedule: Schedule, costs: Mapping[str, float] | None = None, latency: float = 0.0
) -> str:
    """Makespan, both bubbles and the per-stage peak of held activations, in a few lines."""
    sim = schedules.simulate(schedule, costs, latency)
    table = schedules.tick_table(schedule, costs)
    cost_text = " ".join(f"{op}={value:g}" for op, value in sim.costs.items())
    lat = f", latency {latency:g}" if latency else ""
    peaks = " ".join(map(str, schedule.held_peak))
    return "\n".join(
        [
            f"{schedule.kind}: stages={schedule.stages} microbatches={schedule.microbatches} "
            f"virtual_stages={schedule.virtual_stages}",
            f"timeline ({cost_text}{lat}): makespan {sim.makespan:g}, "
            f"bubble {sim.bubble_fraction:.2%}",
            f"lockstep tick table: {table.num_ticks} ticks, bubble {table.bubble_fraction:.2%} "
            f"of slots, {table.weighted_bubble_fraction:.2%} cost-weighted",
            f"peak held (microbatch, chunk) activations per stage: {peaks} "
            f"(max {schedule.max_held})",
        ]
    )


def render_png(
    schedule: Schedule,
    path: str | os.PathLike[str],
    costs: Mapping[str, float] | None = None,
    latency: float = 0.0,
    title: str | None = None,
) -> Path:
    """Draw the simulated timeline: stages as rows (stage 0 on top), time to the right.

    Boxes are coloured by op and carry the microbatch number; with several chunks per stage
    the chunk is written under it and later chunks are drawn lighter.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    sim = schedules.simulate(schedule, costs, latency)
    interleaved = schedule.num_chunks > schedule.stages
    span = max(sim.makespan, 1e-9)
    unit_in = min(0.32, 36.0 / span)  # inches per time unit, capped so huge schedules still fit
    row_in = 0.75 if interleaved else 0.6
    fig = Figure(figsize=(max(6.0, span * unit_in + 2.0), row_in * schedule.stages + 1.4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    font = 8 if unit_in >= 0.25 else 6
    for st, row in enumerate(schedule.actions):
        local = {c: k for k, c in enumerate(schedule.chunks_of(st))}
        for a, (start, end) in zip(row, sim.spans[st], strict=True):
            shade = local[a.chunk] / max(schedule.virtual_stages, 1) if interleaved else 0.0
            ax.broken_barh(
                [(start, end - start)],
                (st - 0.42, 0.84),
                facecolors=COLORS[a.op],
                edgecolors="white",
                linewidth=0.8,
                alpha=1.0 - 0.55 * shade,
            )
            text = f"{a.microbatch}\nc{a.chunk}" if interleaved else str(a.microbatch)
            ax.text(
                (start + end) / 2,
                st,
                text,
                ha="center",
                va="center",
                fontsize=font,
                color="black" if shade > 0.3 else "white",
                linespacing=0.9,
            )
    ax.set_ylim(schedule.stages - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel("time (F=1, B=2, I=1, W=1)" if costs is None else "time")
    ax.grid(axis="x", alpha=0.25)
    ax.set_axisbelow(True)
    used = [op for op in schedules.OPS if any(a.op == op for r in schedule.actions for a in r)]
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    handles = [Patch(color=COLORS[op], label=f"{op}: {names[op]}") for op in used]
    if interleaved:
        handles.append(Patch(color="#bbbbbb", label="lighter = later chunk (c = chunk)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(
        title
        or (
            f"{schedule.kind}: p={schedule.stages}, m={schedule.microbatches}"
            + (f", v={schedule.virtual_stages}" if interleaved else "")
            + f" | bubble {sim.bubble_fraction:.1%} | peak held {schedule.max_held}"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


def _parse_costs(text: str) -> dict[str, float]:
    costs = {}
    for item in filter(None, text.split(",")):
        op, _, value = item.partition("=")
        try:
            costs[op.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--costs item {item!r} must look like B=2") from None
    return costs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fiddlejax schedule",
        description="Build (or load) a pipeline schedule; print its timeline, JSON or picture.",
    )
    parser.add_argument(
        "kind", help=f"one of {', '.join(schedules.kinds())}, or a path to a schedule JSON file"
    )
    parser.add_argument("--stages", "-p", type=int, help="pipeline stages P")
    parser.add_argument("--microbatches", "-m", type=int, help="microbatches M per step")
    parser.add_argument(
        "--virtual-stages", "-v", type=int, default=None, help="chunks per stage (interleaved)"
    )
    parser.add_argument(
        "--steps", "-k", type=int, default=1, help="optimizer steps without a flush (2bw)"
    )
    parser.add_argument("--json", action="store_true", help="print the schedule as JSON")
    parser.add_argument("--png", metavar="FILE", help="write the timeline picture to FILE")
    parser.add_argument("--ticks", action="store_true", help="print the lockstep tick table")
    parser.add_argument("--costs", default="", help="op costs, e.g. F=1,B=2,I=1,W=1")
    parser.add_argument("--latency", type=float, default=0.0, help="cross-stage transfer time")
    return parser


def schedule_command(argv: Sequence[str]) -> int:
    """``fiddlejax schedule KIND --stages P --microbatches M [...]``; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exit_:  # argparse already printed usage or help
        return int(exit_.code or 0)
    try:
        costs = _parse_costs(args.costs) or None
        if args.kind.endswith(".json") or os.path.isfile(args.kind):
            schedule = schedules.load(args.kind)
        else:
            missing = [f"--{n}" for n in ("stages", "microbatches") if getattr(args, n) is None]
            if missing:
                raise ValueError(f"{' and '.join(missing)} required to build {args.kind!r}")
            schedule = schedules.build(
                args.kind, args.stages, args.microbatches, args.virtual_stages, steps=args.steps
            )
        if args.json:
            print(schedules.dump(schedule))
        else:
            if args.ticks:
                print(tick_text(schedule))
            else:
                print(text_timeline(schedule, costs, args.latency))
            print()
            print(summary(schedule, costs, args.latency))
        if args.png:
            out = render_png(schedule, args.png, costs, args.latency)
            print(f"wrote {out}", file=sys.stderr)
    except (ValueError, OSError) as err:
        print(f"fiddlejax schedule: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(schedule_command(sys.argv[1:]))
