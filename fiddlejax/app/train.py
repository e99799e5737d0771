"""The job behind ``fiddlejax train``: build model, data and plan from a config, train, log.

Logs go to the terminal (a rich progress bar on a TTY, one line per ``log_every`` steps
otherwise), to ``metrics.jsonl`` and to TensorBoard events in the run directory. Throughput
figures exclude step 1, which includes compilation. Only process 0 prints and writes logs.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from fiddlejax.app import artifacts, build, checkpoints, guards, logs, nonfinite, preference, runs
from fiddlejax.app import config as config_lib

# Exit codes: 0 done (or preempted and saved), 2 bad input (one line on stderr), 1 a failure while
# training (non-finite loss, a failed save, an unexpected error), 130 interrupted before training.
USER_ERRORS = (ValueError, TypeError, LookupError, OSError)


def main(config_path: str | None, overrides: list[str], debug: bool = False) -> int:
    """Run ``fiddlejax train``; returns the exit code. Errors become one line on stderr
    (2 for bad input, 1 for a failure while training); ``debug`` re-raises them instead."""
    from fiddlejax import distributed

    try:
        code = _train(config_path, overrides)
    except BaseException as e:  # noqa: BLE001 - every error ends as one line and an exit code
        if debug or isinstance(e, SystemExit):
            distributed.goodbye(1)
            raise
        code = report(e)
    distributed.goodbye(code)
    return code


def report(e: BaseException) -> int:
    """Print ``e`` as one line on stderr; the exit code for it."""
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyboardInterrupt):
        print("fiddlejax train: interrupted", file=sys.stderr, flush=True)
        return 130
    # FloatingPointError: a non-finite loss, or a non-finite state a save refused
    if isinstance(e, FloatingPointError | RuntimeError) and not isinstance(e, NotImplementedError):
        code = 1
    elif isinstance(e, USER_ERRORS):
        code = 2
    else:
        text = f"{type(e).__name__}: {text} (run with --debug for the traceback)"
        code = 1
    print(f"fiddlejax train: {text}", file=sys.stderr, flush=True)
    return code


@dataclasses.dataclass
class Job:
    """Everything one run holds: built once by :func:`_start`, walked by :func:`_loop`."""

    cfg: dict
    trainer: Any
    data: Any  # models.Batches
    val_batches: list
    flops: float
    uniform_loss: float
    log: logs.Logger
    ckpt: checkpoints.JobCheckpoints | None = None
    correct: Any = None  # jitted (params, batch) -> (right, examples): classifiers only
    made: artifacts.Artifacts | None = None  # what a refused run takes back (process 0)
    lr: Any = None  # step -> the learning rate(s) the step applied, for the logs
    initial: dict = dataclasses.field(default_factory=dict)  # step 0's validation, logged at 1
    loader: Any = None  # model.from_pretrained: loads by shards at init (build.initial_params)

    def evaluate(self, state) -> float:
        if not self.val_batches:  # train.eval_batches=0: no validation, nothing to compile
            return math.nan
        import numpy as np

        return float(np.mean([float(self.trainer.loss(state, b)) for b in self.val_batches]))

    def accuracy(self, state) -> float | None:
        """Validation accuracy of a classifier (None for other models, or no validation)."""
        if self.correct is None or not self.val_batches:
            return None
        params = self.trainer.params(state)  # canonical; the batch is sharded over data
        right = seen = 0.0
        for b in self.val_batches:
            r, n = self.correct(params, self.trainer.shard_batch(b))
            right, seen = right + float(r), seen + float(n)
        return right / seen


def _correct_fn(entry, model):
    """The model entry's ``correct`` as a jitted function of the canonical parameters."""
    if entry.correct is None:
        return None
    import jax
    from flax import nnx

    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return jax.jit(lambda params, batch: entry.correct(nnx.merge(graphdef, params, rest), batch))


def _train(config_path: str | None, overrides: list[str]) -> int:
    cfg = config_lib.load(config_path, overrides)
    explicit = build.explicit_keys(config_path, overrides)  # the layout fits only the others
    guards.check_config(cfg)  # rules, best metric, a batch beyond this machine's memory
    flags = build.setup_devices(cfg)
    from fiddlejax import distributed
    from fiddlejax.app import compile_cache, host_memory, xla_flags

    host_memory.map_large_blocks()  # freed snapshots and temporaries leave the process

    try:  # joins a multi-process job (SLURM, Open MPI, Kubernetes, launch/local.py); else no-op
        distributed.initialize()
    except RuntimeError as e:  # start-up problems name their fix: bad input, exit 2
        raise config_lib.ConfigError(str(e)) from e
    guards.check_devices(cfg)  # the mesh against the devices, float16 on the CPU
    import jax

    if flags and jax.process_index() == 0:
        _main_print(xla_flags.describe(flags))
    cache = compile_cache.directory(cfg["run"]["compile_cache"])
    if cache is not None and jax.process_index() == 0:
        _main_print(f"compile cache: {cache} (run.compile_cache; the next start reuses it)")
    # what this run creates is taken back if it is refused before its first step
    made = artifacts.Artifacts(cfg) if jax.process_index() == 0 else None
    # checkpoint.dir: checked, then locked for the job's lifetime (a second job is refused)
    lock = checkpoints.lock_directory(cfg, _main_print if jax.process_index() == 0 else _quiet)
    try:
        return _run(cfg, explicit, made)
    except BaseException:
        if lock is not None:
            lock.release()
            lock = None
        if made is not None:
            made.remove()
        raise
    finally:
        if lock is not None:
            lock.release()


def _main_print(text: str) -> None:
    print(text, flush=True)


def _quiet(text: str) -> None:
    pass


def _run(cfg: dict, explicit: set[str] = frozenset(),
         made: artifacts.Artifacts | None = None) -> int:
    job = _start(cfg, explicit)
    job.made = made
    try:
        job.log.print("# initializing the parameters and optimizer state"
                      + (" (or restoring them)" if job.ckpt else ""))
        state, start = (job.ckpt.start(job.loader) if job.ckpt
                        else (job.trainer.init(job.loader), 1))
        job.log.begin(start)
        if job.val_batches:
            job.log.print("# compiling and running the validation loss")
        first_val, first_acc = job.evaluate(state), job.accuracy(state)
        acc_text = f", accuracy {100 * first_acc:.1f}%" if first_acc is not None else ""
        job.log.print(f"step {start - 1}: validation loss {first_val:.4f} "
                      f"(uniform guess: {job.uniform_loss:.4f}){acc_text}" if job.val_batches
                      else f"step {start - 1}: no validation (train.eval_batches=0)")
        if start == 1 and job.val_batches:  # step 1's record keeps it across resumes
            job.initial = {"initial_val_loss": first_val, **({} if first_acc is None else {
                "initial_val_accuracy": first_acc})}
        job.log.print(f"# compiling step {start} (its time includes the compilation)")
        losses, times, val, acc = _loop(job, state, start, first_val, first_acc)
        if job.ckpt is not None:
            job.ckpt.close()
    finally:
        if job.ckpt is not None:
            job.ckpt.close(quiet=True)  # an error is on its way already: wait, release, quiet
        job.log.close()
    if job.log.enabled and losses:
        import jax

        rcfg = cfg["run"]
        run = logs.whole_run(Path(rcfg["dir"]), losses, times, first_val, first_acc)
        losses, times, first_val, first_acc = run
        logs.summary(cfg, losses, times, val, first_val, job.data.items_per_step, job.data.unit,
                     job.flops, jax.device_count(), float(rcfg["peak_tflops"] or 0.0),
                     Path(rcfg["dir"]), None if first_acc is None else (first_acc, acc))
    return 0


def _start(cfg: dict, explicit: set[str] = frozenset()) -> Job:
    """Model, plan, trainer, data, logger and checkpoints of the config, checked first."""
    import jax

    import fiddlejax as fj
    from fiddlejax import distributed

    is_main = jax.process_index() == 0
    tcfg, rcfg = cfg["train"], cfg["run"]
    per_call = int(tcfg.get("steps_per_call", 1))
    if per_call > 1 and jax.process_count() > 1:
        raise config_lib.ConfigError(
            f"train.steps_per_call={per_call} must be 1 when several processes train together; "
            "set train.steps_per_call=1")
    build.resolve_data(cfg)  # data: fits the model; model.vocab_size=auto from the tokenizer
    fitted = build.fit_layout(cfg, explicit)  # a default layout too deep for the model: fitted
    if is_main:
        print("# resolved config\n" + yaml.safe_dump(cfg, sort_keys=False), flush=True)
        if fitted:
            print(fitted, flush=True)
    entry = build.entry(cfg)
    source = cfg["model"].get("from_pretrained")
    say = print if is_main else _quiet
    say(f"# reading model.from_pretrained={source}'s config (its weights load by shards at init)"
        if source else "# building the model")
    model = build.build_model(cfg["model"], tcfg["seed"], weights=False,  # pretrained: shapes
                              lora=cfg["plan"].get("lora"))
    build.check_seq_len(cfg, model)
    if cfg["plan"].get("lora") is not None:
        say(lora_line(model))
    plan = build.make_plan(cfg)
    build.check_layout(cfg, model, plan)  # names the job's keys, before the trainer is built
    loaded, hf_loader = runs.init_weights(cfg, model, plan)  # init_from=DIR: weights only, step 0
    if loaded and is_main:
        print(f"# init_from: weights of {loaded}; fresh optimizer, step 0", flush=True)
    dpo = preference.wanted(cfg)  # preference data: the DPO loss, batches scored first
    trainer = fj.parallelize(model, build.make_optimizer(cfg), plan,
                             loss=preference.loss(cfg, model, plan) if dpo else None)
    if is_main and jax.process_count() > 1:
        print(f"# distributed: {distributed.describe(plan.mesh)}", flush=True)
    # Each process loads only the rows of the data-axis slice its devices own.
    say("# reading and tokenizing the data")
    data = build.build_data(cfg, model, *distributed.data_shard(plan.mesh))
    if dpo:
        data = preference.with_reference(cfg, data, plan)
    val_batches = [next(data.validation) for _ in range(tcfg["eval_batches"])]
    run_dir = Path(rcfg["dir"])
    bar = rcfg["progress"] == "bar" or (rcfg["progress"] == "auto" and sys.stdout.isatty())
    job = Job(cfg, trainer, data, val_batches,
              entry.flops_per_step(model, cfg["data"]["batch_size"]),
              preference.UNIFORM if dpo else entry.uniform_loss(model),
              logs.Logger(run_dir, is_main, bar, tcfg["steps"]),
              correct=None if dpo else _correct_fn(entry, model),
              lr=build.learning_rates(cfg), loader=hf_loader or build.initial_params(model))
    try:
        if is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        # checkpoint.dir and resume: saving, resuming, SIGTERM/SIGINT (fiddlejax/app/checkpoints)
        job.ckpt = checkpoints.for_run(cfg, trainer, data.train, job.log.print)
    except BaseException:
        job.log.close()
        raise
    return job


def lora_line(model) -> str:
    """What ``plan.lora`` trains: its adapters' parameters, against the whole model's."""
    from flax import nnx

    from fiddlejax.finetune import lora

    n, total = lora.trainable_count(nnx.state(model, nnx.Param))
    return (f"# plan.lora: training {n:,} adapter parameters ({100 * n / total:.2f}% of "
            f"{total:,}); the base is frozen (no gradients, no optimizer state)")


def _loop(job: Job, state, start: int, val: float, acc: float | None
          ) -> tuple[list, list, float, float | None]:
    """Steps ``start`` .. ``train.steps``; (losses, step times after the first call, last
    validation loss, last validation accuracy). Stops early, saved, when preempted."""
    import jax
    import numpy as np

    from fiddlejax.app import host_memory

    cfg, trainer, tcfg = job.cfg, job.trainer, job.cfg["train"]
    per_call, n_dev = int(tcfg.get("steps_per_call", 1)), jax.device_count()
    peak = float(cfg["run"]["peak_tflops"] or 0.0)
    times, losses = [], []
    t_prev = time.perf_counter()
    step, stop = start, False
    guard = nonfinite.NonFiniteSteps(cfg, job.ckpt, job.log.print,
                                     job.ckpt.skipped_before if job.ckpt else 0)
    while step <= tcfg["steps"] and not stop:
        # One call runs k steps (several in one program: PipeDream-2BW's unflushed pipeline).
        k = min(per_call, tcfg["steps"] - step + 1)
        batches = [next(job.data.train) for _ in range(k)]
        if k == 1 and step == start:  # compiled apart, its freed memory returned before the
            trainer.precompile(state, batches[0])  # step's temporaries join the state
            host_memory.release()
        if k == 1:
            state, metrics = trainer.step(state, batches[0])
            metrics = {name: [v] for name, v in metrics.items()}
        else:
            state, metrics = trainer.steps(
                state, {key: np.stack([b[key] for b in batches]) for key in batches[0]})
        # One transfer (it syncs: time runs to completion). A step whose loss or gradient norm
        # is not finite was not applied (in-graph); the guard counts it or stops the job.
        # the step's own metrics, and any the model's loss reports (an MoE router's losses)
        host = jax.device_get(metrics)
        reported = [k for k in host if k not in ("loss", "grad_norm", "nonfinite_skipped",
                                                 "bad_ids")]
        step_losses = [float(x) for x in host["loss"]]
        norms = [float(x) for x in host["grad_norm"]]
        skipped = guard.check(step, step_losses, norms, [int(x) for x in host.get(
            "nonfinite_skipped", [0] * k)], [int(x) for x in host.get("bad_ids", [0] * k)])
        now = time.perf_counter()
        dt, t_prev = (now - t_prev) / k, now
        for i, loss in enumerate(step_losses):
            s, last = step + i, i == k - 1
            if step > start:  # the first call compiles
                times.append(dt)
            losses.append(loss)
            rec = {"loss": loss, **{k: float(host[k][i]) for k in reported},
                   "grad_norm": norms[i], "step_time_s": dt}
            if guard.total:
                rec["nonfinite_skipped"] = guard.total
            rec.update(logs.throughput(dt, job.data.items_per_step, job.flops, n_dev, peak,
                                       job.data.unit))
            rec.update(job.lr(s))
            if s == 1:
                rec.update(job.initial)
            rec.update(logs.device_memory())
            eval_due = tcfg["eval_every"] and any(
                (j % tcfg["eval_every"] == 0 or j == tcfg["steps"]) for j in range(step, s + 1))
            if last and eval_due and job.val_batches:  # the state exists at the end of a call
                val = rec["val_loss"] = job.evaluate(state)
                acc = job.accuracy(state)
                if acc is not None:
                    rec["val_accuracy"] = acc
                t_prev = time.perf_counter()  # evaluation is not step time
            stop = last and job.ckpt is not None and job.ckpt.after_step(s, state, rec,
                                                                         skipped[i])
            shown = s % tcfg["log_every"] == 0 or s == 1 or "val_loss" in rec
            job.log.log(s, rec, logs.line(s, rec) if shown else None)
            if job.made is not None:
                job.made.kept = True  # a step ran: the run's files are its own now
        step += k
    return losses, times, val, acc


if __name__ == "__main__":
    sys.exit(main(None, sys.argv[1:]))
