"""Regenerate every CPU report in benchmarks/results/, each by the exact command it records.

``REPORTS`` names, for every report, the command that writes it whole and its inputs: the script
(implied) and the runtime modules it measures. ``tests/test_reports.py`` reads this table (and
each report's header, see ``benchmarks/reporting.py``): a report is stale when one of its inputs
changed in a commit after the one its header names. ``GPU_REPORTS`` were made on a lent GPU; the
CPU runner cannot remake them and says so.

    python benchmarks/run.py --cpu                 # every CPU report, one after another
    python benchmarks/run.py --cpu --only pipeline_memory.md,overhead.md
    python benchmarks/run.py --list                # the commands, and what is left out and why

Time on the 2-core development machine: see docs/benchmarks.md ("Regenerating the reports").
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a compiled training step runs: the Trainer, the plan, the parallel layouts, remat, and
# every other module a Trainer's step imports (sys.modules after GPT's first step).
STEP = ("fiddlejax/train.py", "fiddlejax/plan.py", "fiddlejax/mesh.py", "fiddlejax/sharding.py",
        "fiddlejax/staged.py", "fiddlejax/state.py", "fiddlejax/batches.py", "fiddlejax/adaptation",
        "fiddlejax/compute", "fiddlejax/memory", "fiddlejax/parallel", "fiddlejax/canonical.py",
        "fiddlejax/checks.py", "fiddlejax/intercept.py", "fiddlejax/layout.py",
        "fiddlejax/message.py", "fiddlejax/collectives", "fiddlejax/finetune",
        "fiddlejax/models/feed.py", "fiddlejax/models/model_names.py")
PIPE = ("fiddlejax/pipeline",)
GPT = ("fiddlejax/models/gpt.py", "fiddlejax/models/common.py")
LLAMA = ("fiddlejax/models/llama.py", "fiddlejax/models/decoder.py",
         "fiddlejax/models/decoder_config.py", "fiddlejax/models/rope.py",
         "fiddlejax/models/common.py")
MOE = ("fiddlejax/models/moe.py", "fiddlejax/models/moe_lm.py", "fiddlejax/models/moe_loss.py",
       "fiddlejax/models/grouped.py")
# The shared decoder the Hugging Face families build on (Mixtral, Qwen3-MoE, GPT-OSS, ...)
DECODER = ("fiddlejax/models/decoder.py", "fiddlejax/models/decoder_config.py",
           "fiddlejax/models/rope.py", "fiddlejax/models/common.py")
PLANNER = ("fiddlejax/planner",)
APP = ("fiddlejax/app", "fiddlejax/cli.py", "fiddlejax/configs", "fiddlejax/data")
CKPT = ("fiddlejax/checkpoint", "fiddlejax/memory/storage.py")


@dataclass(frozen=True)
class Report:
    """One report: the script and arguments that write it whole, and what it measures."""

    script: str
    args: str = ""
    inputs: tuple[str, ...] = ()
    companions: tuple[str, ...] = ()  # other files of results/ the same run writes
    # modules the script imports that this report's figures do not run (another report's
    # model, a mode of the script this command does not take): tests/test_reports.py
    # checks every other fiddlejax module the script imports is among the inputs
    unmeasured: tuple[str, ...] = ()
    # modules (or folders) its process imports through the fiddlejax package but never runs:
    # left out of the modules its report records (tests/test_reports.py's staleness); the
    # declared inputs count whatever this says
    not_run: tuple[str, ...] = ()

    def runs(self, module: str) -> bool:
        """Whether a module the run recorded importing counts toward its staleness (it is not
        under ``not_run``; the declared inputs count regardless)."""
        return not any(module == p or module.startswith(p.rstrip("/") + "/")
                       for p in self.not_run)

    @property
    def command(self) -> str:
        return f"python benchmarks/{self.script} {self.args}".strip()

    def paths(self) -> list[str]:
        return [f"benchmarks/{self.script}", *self.inputs]


REPORTS: dict[str, Report] = {
    "pipeline_memory.md": Report("pipeline_memory.py", "--quick", STEP + PIPE + GPT),
    "hetero_pipeline.md": Report("hetero_pipeline.py", "", STEP + PIPE + PLANNER),
    "dpo_reference_memory.md": Report("dpo_reference_memory.py", "",
                                      STEP + PIPE + LLAMA + ("fiddlejax/finetune",)),
    "pipeline_vs_baseline.md": Report("pipeline_vs_baseline.py", "--quick", STEP + PIPE + GPT),
    "pipeline_flops.md": Report("pipeline_flops.py", "--quick",
                                STEP + PIPE + GPT + ("fiddlejax/memory",)),
    "pipeline_efficiency.md": Report("pipeline_efficiency.py", "--quick",
                                     STEP + PIPE + GPT + ("fiddlejax/memory",)),
    "pipeline_2bw.md": Report("pipeline_2bw.py", "--quick", STEP + PIPE + GPT,
                              unmeasured=("fiddlejax/app/build.py", "fiddlejax/app/config.py")),
    "pipeline_2bw_train.md": Report("pipeline_2bw.py", "--train-table", STEP + PIPE + GPT + APP),
    # one device, no Trainer: the config, data, model and optimizer (stale_correction
    # included), every module a profiled row calls (tests/test_reports.py checks it)
    "pipeline_2bw_reference.md": Report(
        "pipeline_2bw.py", "--reference-table --jobs 2",
        APP + GPT + ("fiddlejax/__init__.py", "fiddlejax/intercept.py",
                     "fiddlejax/models/__init__.py", "fiddlejax/models/feed.py",
                     "fiddlejax/models/model_names.py", "fiddlejax/pipeline/staleness.py",
                     "fiddlejax/pipeline/schedules/registry.py"),
        not_run=STEP + PIPE),
    "overhead.md": Report("overhead.py", "", STEP + GPT),
    "lockstep.md": Report("lockstep.py", "", STEP + PIPE + GPT),
    "vocab_parallel.md": Report("vocab_parallel.py", "--baseline-commit b7c3edd",
                                STEP + PIPE + GPT),
    "planner_megatron.md": Report("planner_megatron.py", "", PLANNER),
    "memory.md": Report("memory.py", "", STEP + GPT + ("fiddlejax/memory",
                                                       "fiddlejax/models/cnn.py")),
    "collectives.md": Report("collectives.py", "", ("fiddlejax/collectives",),
                             ("collectives_time_vs_size.png",)),
    "topk.md": Report("topk.py", "--dense-warmup 60",
                      STEP + APP + GPT + ("fiddlejax/collectives",)),
    "checkpoint.md": Report("checkpoint.py", "", STEP + GPT + CKPT),
    "context.md": Report("context.py", "", STEP + LLAMA + PLANNER),
    "context_state.md": Report("context_state.py", "",
                               STEP + LLAMA + ("fiddlejax/app/build.py",)),
    "expert_parallel.md": Report("expert_parallel.py", "--check",
                                 STEP + MOE + ("fiddlejax/models/common.py",)),
    "moe_dispatch.md": Report("moe_dispatch.py", "", MOE + ("fiddlejax/parallel/expert.py",)),
    "fsdp_gather_dtype.md": Report(
        "fsdp_gather_dtype.py", "--hidden 512 --layers 8 --shapes 256x16,32x8", STEP + LLAMA),
    "fsdp_gather_once.md": Report("fsdp_gather_once.py", "--compile",
                                  STEP + PIPE + LLAMA + PLANNER),
    "fsdp_prefetch.md": Report("fsdp_prefetch.py",
                               "--hidden 512 --layers 8 --seq 256 --batch 16", STEP + LLAMA),
    "long_context.md": Report("long_context.py", "--platform cpu",
                              STEP + PIPE + LLAMA + PLANNER + ("fiddlejax/app/xla_flags.py",)),
    "scale.md": Report("scale.py", "", STEP + PIPE + LLAMA + PLANNER),
    "scale_families.md": Report("scale_families.py", "--pipelined",
                                STEP + PIPE + LLAMA + PLANNER + ("fiddlejax/models/families.py",)),
    "scale_moe.md": Report("scale_moe.py", "--layout 1,2,1,8,1 --layout 2,2,1,4,1",
                           STEP + PIPE + MOE + PLANNER + DECODER,
                           unmeasured=("fiddlejax/models/deepseek.py",
                                       "fiddlejax/models/gpt_oss.py")),
    "scale_gpt_oss_120b.md": Report(
        "scale_moe.py", "--model gpt-oss-120b",
        STEP + PIPE + MOE + PLANNER + ("fiddlejax/models/gpt_oss.py",
                                       "fiddlejax/models/gpt_oss_config.py",
                                       "fiddlejax/models/decoder.py"),
        unmeasured=("fiddlejax/models/deepseek.py",)),
    "scale_gpt_oss_120b_bf16.md": Report(
        "scale_moe.py",
        "--model gpt-oss-120b --precision bf16 --gpus 16 --schedule 1f1b --schedule zb-h1",
        STEP + PIPE + MOE + PLANNER + ("fiddlejax/models/gpt_oss.py",
                                       "fiddlejax/models/gpt_oss_config.py",
                                       "fiddlejax/models/decoder.py"),
        unmeasured=("fiddlejax/models/deepseek.py",)),
    "scale_deepseek_v3.md": Report(
        "scale_moe.py", "--model deepseek-v3",
        STEP + PIPE + MOE + PLANNER + ("fiddlejax/models/deepseek.py",
                                       "fiddlejax/models/deepseek_config.py",
                                       "fiddlejax/models/deepseek_moe.py",
                                       "fiddlejax/models/mla.py", "fiddlejax/models/mtp.py",
                                       "fiddlejax/models/decoder.py"),
        unmeasured=("fiddlejax/models/gpt_oss.py",)),
    "fp8.md": Report("fp8.py", "", STEP + PIPE + APP + GPT + ("fiddlejax/compute/fp8.py",)),
    "hf_checkpoint_memory.md": Report("hf_checkpoint_memory.py", "",
                                      STEP + APP + LLAMA + CKPT + ("fiddlejax/models/hub.py",
                                                                   "fiddlejax/models/hf.py",
                                                                   "fiddlejax/models/hf_io.py")),
    "zero3_vocab_memory.md": Report("zero3_vocab_memory.py", "", STEP + LLAMA),
    "zero3_temp.md": Report("zero3_temp.py", "", STEP + MOE + LLAMA),
    "input_pipeline.md": Report("input_pipeline.py", "", STEP + APP + GPT,
                                ("input_pipeline.json",)),
    "data_store.md": Report("data_store.py", "", APP, ("data_store.json",)),
    "faults.md": Report("faults.py", "--kills 4 --trials 2 --seed 0",
                        STEP + APP + CKPT + ("fiddlejax/distributed",)),
    "suite.md": Report("suite.py", "--quick", STEP + PIPE + GPT + PLANNER +
                       ("fiddlejax/models/bert.py",), ("suite.json", "suite.png")),
}

# Made on a lent GPU: the CPU runner cannot remake them. Their figures stay as measured; the
# staleness test names the changed inputs instead of failing (no GPU in CI).
GPU_REPORTS: dict[str, tuple[Report, str]] = {
    "mfu.md": (Report("mfu.py", "", STEP + PIPE + LLAMA + ("fiddlejax/app/xla_flags.py",)),
               "step times and MFU of one NVIDIA H200 (jax 0.11.2); a CPU has no MFU"),
    "long_context_gpu.md": (Report("long_context.py", "--platform gpu",
                                   STEP + PIPE + LLAMA + PLANNER
                                   + ("fiddlejax/app/xla_flags.py",)),
                            "XLA's GPU compiler (one H200 and 7 mock GPUs); needs a GPU"),
}


def run(names: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t_all, failed = time.perf_counter(), []
    for name in names:
        rep = REPORTS[name]
        print(f"[run] {name}: {rep.command}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, f"benchmarks/{rep.script}",
                              *shlex.split(rep.args)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL if len(names) > 1 else None)
        print(f"[run] {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"[run] {len(names) - len(failed)} of {len(names)} reports written in "
          f"{time.perf_counter() - t_all:.0f} s; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="regenerate every CPU report")
    ap.add_argument("--only", default="", help="comma-separated report names (with --cpu)")
    ap.add_argument("--list", action="store_true", help="print the commands; run nothing")
    args = ap.parse_args()
    if args.list or not args.cpu:
        for name, rep in REPORTS.items():
            print(f"{name:26s} {rep.command}")
        for name, (rep, why) in GPU_REPORTS.items():
            print(f"{name:26s} not run by --cpu: {why} ({rep.command})")
        return 0 if args.list else 2
    names = [n for n in args.only.split(",") if n] or list(REPORTS)
    unknown = [n for n in names if n not in REPORTS]
    if unknown:
        raise SystemExit(f"--only: unknown report(s) {unknown}; choose from {sorted(REPORTS)}"
                         + (f" (GPU reports {sorted(GPU_REPORTS)} are not run here)"
                            if set(unknown) & set(GPU_REPORTS) else ""))
    return run(names)


if __name__ == "__main__":
    sys.exit(main())
