"""What the job reports: metrics.jsonl, TensorBoard, the terminal (lines or a rich bar) and the
closing summary. Only process 0 writes; throughput excludes step 1, which compiles."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


class Logger:
    """metrics.jsonl + TensorBoard + terminal; silent on processes other than 0.

    The files open at :meth:`begin`, once the first step is known: a resumed run drops the
    records of the steps it re-runs (metrics.jsonl lines, TensorBoard events via ``purge_step``),
    so every step appears once.
    """

    def __init__(self, run_dir: Path, enabled: bool, bar: bool, total: int):
        self.enabled, self.bar, self.run_dir = enabled, bar, run_dir
        self.file = self.tb = self.progress = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if bar:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"),
                                     BarColumn(), TextColumn("{task.fields[info]}"),
                                     TimeRemainingColumn())
            self.task = self.progress.add_task("train", total=total, info="compiling")
            self.progress.start()

    def begin(self, start: int) -> None:
        """Open the logs for a run whose first step is ``start``."""
        if not self.enabled:
            return
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            keep = [x for x in lines if _step_of(x) is not None and _step_of(x) < start]
            if len(keep) != len(lines):
                path.write_text("".join(x + "\n" for x in keep))
                self.print(f"{path}: dropped {len(lines) - len(keep)} records of steps >= "
                           f"{start} (this run writes them again)")
        self.file = open(path, "a")  # noqa: SIM115
        from tensorboardX import SummaryWriter

        self.tb = SummaryWriter(str(self.run_dir), purge_step=start if start > 1 else None)

    def log(self, step: int, metrics: dict, line: str | None) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            if isinstance(v, int | float) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, info=line or "")
        elif line:
            print(line, flush=True)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.file:
            self.file.close()
            self.tb.close()
            self.file = None


def device_memory() -> dict:
    """Device 0's memory in use and its peak (bytes); on the CPU, whose devices report none,
    the process's peak resident memory (they live in it)."""
    import jax

    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    if not stats and dev.platform == "cpu":
        import resource

        return {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return {name: int(stats[key]) for name, key in (
        ("memory_bytes", "bytes_in_use"), ("peak_memory_bytes", "peak_bytes_in_use"))
        if key in stats}


def whole_run(run_dir: Path, losses: list[float], times: list[float], first_val: float,
              first_acc: float | None) -> tuple[list, list, float, float | None]:
    """(losses, step times, first validation loss and accuracy) of the whole run: a resumed
    run's own, after those of the steps before it in metrics.jsonl (step 1's time, which
    compiles, left out; so is each resumed start's, of this run)."""
    path = run_dir / "metrics.jsonl"
    recs = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            r = json.loads(line)
            recs[int(r["step"])] = r
        except (ValueError, KeyError, TypeError):
            continue
    start = max(recs, default=0) - len(losses) + 1
    before = [recs[s] for s in sorted(recs) if s < start]
    if not before:
        return losses, times, first_val, first_acc
    first = before[0]
    return ([float(r["loss"]) for r in before] + losses,
            [float(r["step_time_s"]) for r in before if r["step"] > 1] + times,
            float(first.get("initial_val_loss", math.nan)), first.get("initial_val_accuracy"))


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


UNITS = {"tokens": "tok/s", "examples": "ex/s"}  # what a step consumes -> its rate's label


def throughput(dt: float, items: int, flops: float, n_dev: int, peak: float,
               unit: str = "tokens") -> dict:
    """``<unit>_per_s`` (tokens or examples), TFLOP/s per device and (``peak`` TFLOP/s known)
    MFU of one step."""
    tflops = flops / dt / n_dev / 1e12
    out = {f"{unit}_per_s": items / dt, "tflops_per_device": tflops}
    if peak > 0:
        out["mfu"] = tflops / peak
    return out


def line(step: int, r: dict) -> str:
    """One terminal line for step ``step``'s record."""
    unit = next((u for u in UNITS if f"{u}_per_s" in r), "tokens")
    s = f"step {step:5d} | loss {r['loss']:.4f} | "
    if "moe_aux_loss" in r:  # an MoE model's router: its balance and drops
        s += f"aux {r['moe_aux_loss']:.4f} | "
        s += f"dropped {r['moe_dropped']:.0f} | " if r.get("moe_dropped") else ""
    if "mtp_loss" in r:  # DeepSeek-V3's multi-token prediction, before its weight
        s += f"mtp {r['mtp_loss']:.4f} | "
    s += (f"{r['step_time_s'] * 1e3:7.1f} ms | {r[f'{unit}_per_s']:9.0f} {UNITS[unit]} | "
          f"{r['tflops_per_device']:.4f} TFLOP/s/dev")
    if "mfu" in r:
        s += f" | MFU {100 * r['mfu']:.1f}%"
    if "val_loss" in r:
        s += f" | val {r['val_loss']:.4f}"
    if "val_accuracy" in r:
        s += f" | val acc {100 * r['val_accuracy']:.1f}%"
    if "lr" in r:
        s += f" | lr {r['lr']:.2e}"
    return s


def schedule_ran(p: dict) -> str:
    """The pipeline schedule as it ran: an interleaved kind with its virtual stages."""
    from fiddlejax.plan import interleaves

    if p["schedule"] is None:
        return "schedule=null (no pipeline)"
    if not interleaves(p["schedule"]):
        return f"schedule={p['schedule']}"
    v = p["virtual_stages"] or 2
    return f"schedule={p['schedule']} x{v} virtual stage{'s' if v > 1 else ''}"


def summary(cfg: dict, losses: list[float], times: list[float], val: float, first_val: float,
            items: int, unit: str, flops: float, n_dev: int, peak: float, run_dir: Path,
            accuracy: tuple[float, float] | None = None) -> None:
    """The closing table on the terminal and ``summary.json`` in the run directory
    (``accuracy``: validation accuracy at the start and the end, for classifiers)."""
    from rich.console import Console
    from rich.table import Table

    med = statistics.median(times) if times else float("nan")
    t = Table(title="fiddlejax train: summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    mesh = cfg["mesh"]
    t.add_row("layout", f"data={mesh['data']} pipe={mesh['pipe']} tensor={mesh['tensor']} "
                        + "".join(f"{k}={mesh[k]} " for k in ("context", "expert")
                                  if mesh.get(k, 1) != 1) + schedule_ran(cfg["plan"]))
    t.add_row("steps", str(len(losses)))
    t.add_row("train loss (first -> last)", f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    t.add_row("validation loss (start -> end)", f"{first_val:.4f} -> {val:.4f}"
              if not math.isnan(first_val) else "none (train.eval_batches=0)")
    if accuracy is not None:
        t.add_row("validation accuracy (start -> end)",
                  f"{100 * accuracy[0]:.1f}% -> {100 * accuracy[1]:.1f}%")
    t.add_row("median step time (excl. step 1)", f"{med * 1e3:.1f} ms")
    t.add_row(f"{unit}/s", f"{items / med:.0f}")
    t.add_row("TFLOP/s per device", f"{flops / med / n_dev / 1e12:.4f}")
    if peak > 0:
        t.add_row("MFU", f"{100 * flops / med / n_dev / 1e12 / peak:.1f}%")
    t.add_row("run directory", str(run_dir))
    Console().print(t)
    record = {"final_loss": losses[-1], "final_val_loss": val, "initial_val_loss": first_val,
              "median_step_time_s": med, "steps": len(losses), f"{unit}_per_s": items / med}
    if accuracy is not None:
        record.update(initial_val_accuracy=accuracy[0], final_val_accuracy=accuracy[1])
    with open(run_dir / "summary.json", "w") as f:
        json.dump(record, f, indent=1)
