"""The job behind ``fiddlejax train``: build model, data and plan from a config, train, log.

Logs go to the terminal (a rich progress bar on a TTY, one line per ``log_every`` steps
otherwise), to ``metrics.jsonl`` and to TensorBoard events in the run directory. Throughput
figures exclude step 0, which includes compilation. Only process 0 prints and writes logs.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import yaml

from fiddlejax import config as config_lib

# Exit codes: 0 done (or preempted and saved), 2 bad input (one line on stderr), 1 a failure while
# training (non-finite loss, a failed save, an unexpected error), 130 interrupted before training.
USER_ERRORS = (ValueError, TypeError, LookupError, OSError)


def setup_devices(cfg: dict) -> None:
    """Simulate ``run.cpu_devices`` CPU devices; must run before JAX starts its backends."""
    n = int(cfg["run"]["cpu_devices"] or 0)
    if n > 0:
        import jax

        jax.config.update("jax_num_cpu_devices", n)


def build_model(mcfg: dict, seed: int):
    from flax import nnx

    name = mcfg["name"]
    rngs = nnx.Rngs(seed)
    if mcfg.get("from_pretrained") and name != "llama":
        raise ValueError(f"model.from_pretrained={mcfg['from_pretrained']!r} needs "
                         f"model.name=llama (got {name!r})")
    if name == "gpt":
        from models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(**_pick(mcfg, GPTConfig)), rngs=rngs)
    if name == "bert":
        from models.bert import BERT, BERTConfig

        fields = _pick(mcfg, BERTConfig)
        fields["vocab_size"] = mcfg["vocab_size"] + 1  # + [MASK]
        return BERT(BERTConfig(**fields), rngs=rngs)
    if name == "cnn":
        from models.cnn import CNN, CNNConfig

        return CNN(CNNConfig(channels=mcfg["channels"], n_layers=mcfg["n_layers"]), rngs=rngs)
    if name == "llama":
        from models.llama import Llama, LlamaConfig

        if mcfg.get("from_pretrained"):  # a Hugging Face directory: its config.json sets the dims
            return Llama.from_pretrained(mcfg["from_pretrained"], seq_len=mcfg["seq_len"])
        return Llama(LlamaConfig(
            vocab_size=mcfg["vocab_size"], hidden_size=mcfg["d_model"],
            intermediate_size=mcfg["d_ff"], num_hidden_layers=mcfg["n_layers"],
            num_attention_heads=mcfg["n_heads"], num_key_value_heads=mcfg["n_kv_heads"],
            rope_theta=float(mcfg["rope_theta"]), tie_word_embeddings=mcfg["tie_embeddings"],
            max_position_embeddings=mcfg["seq_len"], seq_len=mcfg["seq_len"]), rngs=rngs)
    raise ValueError(f"model.name={name!r} must be one of gpt, bert, cnn, llama")


def _pick(mcfg: dict, cls) -> dict:
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in mcfg.items() if k in names}


def build_data(cfg: dict, model, process_index: int, process_count: int):
    """(train iterator, validation batch list, tokens-or-examples per step)."""
    from fiddlejax import data

    name, b, seed = cfg["model"]["name"], cfg["data"]["batch_size"], cfg["data"]["seed"]
    shard = {"process_index": process_index, "process_count": process_count}
    if name == "cnn":
        tr = data.digits("train")
        va = data.digits("validation")
        train = data.image_batches(*tr, b, seed=seed, **shard)
        val = data.image_batches(*va, b, shuffle=False, repeat=True, **shard)
        return iter(train), iter(val), b
    seq = cfg["model"]["seq_len"]
    need = seq + 1 if name in ("gpt", "llama") else seq
    # ids must fit the model: checked once over the whole source (bert's [MASK] id excluded)
    vocab = cfg["model"]["vocab_size"] if name == "bert" else getattr(
        getattr(model, "config", None), "vocab_size", None)
    corpus = data.stdlib_corpus("train")
    if vocab is not None:
        data.check_tokens(corpus, vocab, "the stdlib corpus (model.vocab_size)")
    train = data.token_batches(corpus, need - 1, b, seed=seed, **shard)
    val = data.token_batches(data.stdlib_corpus("validation"), need - 1, b, shuffle=False,
                             **shard)
    train_it, val_it = iter(train), iter(val)
    if name == "bert":
        rows = {"first_row": process_index * (b // process_count), "global_rows": b}
        return (MaskedBatches(train_it, model.config, seed, **rows),
                MaskedBatches(val_it, model.config, seed + VALIDATION_MASK_SEED, **rows), b * seq)
    return train_it, val_it, b * seq


VALIDATION_MASK_SEED = 1 << 20  # validation masks come from seeds the training batches never use


class MaskedBatches:
    """BERT's masked-LM batches over a token-batch iterator. Batch n is masked with seed
    ``seed + n``, each process masking its own rows of the global batch. The state (the token
    stream's and n) is checkpointed, so a resumed run sees the batches and masks the
    uninterrupted run would have."""

    def __init__(self, tokens, config, seed: int, first_row: int = 0,
                 global_rows: int | None = None):
        self.tokens, self.config, self.seed, self.n = tokens, config, seed, 0
        self.rows = {"first_row": first_row, "global_rows": global_rows}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        import numpy as np

        from models.bert import mlm_batch

        batch = next(self.tokens)
        self.n += 1
        return mlm_batch(np.asarray(batch["tokens"]), self.config, self.seed + self.n,
                         **self.rows)

    def get_state(self) -> dict:
        return {"tokens": self.tokens.get_state(), "batches": self.n}

    def set_state(self, state: dict) -> None:
        self.tokens.set_state(state["tokens"])
        self.n = int(state["batches"])


def model_flops_per_step(cfg: dict, model, batch_size: int) -> float:
    """Analytic training FLOPs of one step (forward + backward, no remat), whole batch."""
    m = cfg["model"]
    if m["name"] == "cnn":
        c, hw = m["channels"], 8 * 8
        per_example = m["n_layers"] * 2 * (2 * 9 * c * c * hw)  # two 3x3 convs per layer
        return 3.0 * per_example * batch_size
    import jax
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    if m["name"] == "llama":  # dims from the model: model.from_pretrained overrides the config's
        c = model.config
        if not c.tie_word_embeddings:
            n -= params["embed"][...].size  # a lookup; tied, it is the head's matmul as well
        tokens = batch_size * m["seq_len"]
        attn = 12.0 * c.num_hidden_layers * m["seq_len"] * c.num_attention_heads * c.head_dim
        return 6.0 * n * tokens + attn * tokens
    n -= params["wte"][...].size + params["wpe"][...].size  # lookups, not matmuls
    d, L, T = m["d_model"], m["n_layers"], m["seq_len"]
    if m.get("tie_embeddings") and m["name"] == "gpt":
        n += params["wte"][...].size  # the tied head is a matmul
    tokens = batch_size * T
    return 6.0 * n * tokens + 12.0 * L * T * d * tokens


def make_plan(cfg: dict):
    import fiddlejax as fj
    from fiddlejax.plan import interleaves

    mesh = fj.make_mesh(**cfg["mesh"])
    p = cfg["plan"]
    virtual = p["virtual_stages"]
    if virtual is None:  # automatic: what the schedule kind expects
        virtual = 2 if interleaves(p["schedule"]) else 1
    budget = p.get("memory_budget")
    if budget is not None:
        budget = config_lib.parse_bytes(budget, "plan.memory_budget")
    elif p["remat"] == "auto":
        budget = default_memory_budget()
    return fj.Plan(mesh=mesh, schedule=p["schedule"], microbatches=p["microbatches"],
                   virtual_stages=virtual, remat=p["remat"],
                   encodings=tuple(p["encodings"] or ()), grad_allreduce=p["grad_allreduce"],
                   topk_density=p["topk_density"], topk_on=p["topk_on"],
                   zero=p["zero"], partition=p["partition"], memory_budget=budget,
                   check_inputs=bool(p.get("check_inputs", False)))


def default_memory_budget(share: float = 0.9) -> int:
    """``plan.memory_budget=null`` with ``remat=auto``: 90% of what the device reports."""
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if not stats.get("bytes_limit"):
        raise config_lib.ConfigError(
            f"plan.remat=auto needs plan.memory_budget=<bytes per device> (e.g. "
            f"plan.memory_budget=2GiB): the {dev.platform} device does not report its memory")
    return int(share * stats["bytes_limit"])


def uniform_loss(model) -> float:
    """The loss of a uniform guess over the model's outputs (classes or vocabulary)."""
    c = getattr(model, "config", None)
    n = getattr(c, "num_classes", None) or getattr(c, "vocab_size", None)
    return math.log(n) if n else math.nan


# Muon orthogonalizes each layer's matrices: which axes of a stacked block leaf are the matrix's
# input (reduction) and output axes, counted from the end so every parallel layout agrees.
MUON_AXES = {"w1": ((-2,), (-1,)), "w2": ((-2,), (-1,)), "wq": ((-3,), (-2, -1)),
             "wk": ((-3,), (-2, -1)), "wv": ((-3,), (-2, -1)), "wo": ((-3, -2), (-1,)),
             "k1": ((-4, -3, -2), (-1,)), "k2": ((-4, -3, -2), (-1,)),
             "w3": ((-2,), (-1,))}  # Llama's SwiGLU up projection


def muon_dimensions(params):
    """Muon's dimension numbers for the models' block matrices; None (AdamW) for the rest:
    embeddings, heads, norms and biases, as Muon's authors recommend."""
    import jax
    from optax.contrib import MuonDimensionNumbers

    def dims(path, _):
        keys = [getattr(k, "key", None) for k in path]
        axes = MUON_AXES.get(keys[1]) if len(keys) > 1 and keys[0] == "blocks" else None
        return MuonDimensionNumbers(*axes) if axes else None

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(cfg: dict):
    import optax

    o, steps = cfg["optimizer"], cfg["train"]["steps"]
    warm = min(o["warmup_steps"], max(steps - 1, 1))

    def schedule(peak: float):
        return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1),
                                                  peak * 0.1)

    name = o.get("name", "adamw")
    if name == "adamw":
        tx = optax.adamw(schedule(o["lr"]), b1=o["b1"], b2=o["b2"],
                         weight_decay=o["weight_decay"], nesterov=bool(o.get("nesterov")))
    elif name == "muon":
        from optax.contrib import muon

        tx = muon(schedule(o["muon_lr"]), weight_decay=o["weight_decay"],
                  adam_learning_rate=schedule(o["lr"]), adam_b1=o["b1"], adam_b2=o["b2"],
                  adam_weight_decay=o["weight_decay"],
                  muon_weight_dimension_numbers=muon_dimensions)
    else:
        raise ValueError(f"optimizer.name={name!r} must be adamw or muon")
    if o.get("stale_correction"):
        import fiddlejax as fj

        tx = fj.stale_correction(tx, float(o["stale_correction"]))
    return optax.chain(optax.clip_by_global_norm(o["clip"]), tx) if o["clip"] else tx


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


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


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
    from fiddlejax.checks import NonFiniteLoss

    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, KeyboardInterrupt):
        print("fiddlejax train: interrupted", file=sys.stderr, flush=True)
        return 130
    if isinstance(e, NonFiniteLoss | RuntimeError) and not isinstance(e, NotImplementedError):
        code = 1
    elif isinstance(e, USER_ERRORS):
        code = 2
    else:
        text = f"{type(e).__name__}: {text} (run with --debug for the traceback)"
        code = 1
    print(f"fiddlejax train: {text}", file=sys.stderr, flush=True)
    return code


def _train(config_path: str | None, overrides: list[str]) -> int:
    cfg = config_lib.load(config_path, overrides)
    setup_devices(cfg)
    from fiddlejax import distributed

    try:  # joins a multi-process job (SLURM, Open MPI, Kubernetes, launch/local.py); else no-op
        distributed.initialize()
    except RuntimeError as e:  # start-up problems name their fix: bad input, exit 2
        raise config_lib.ConfigError(str(e)) from e
    import jax
    import numpy as np

    import fiddlejax as fj
    from fiddlejax import checkpoint
    from fiddlejax.checks import NonFiniteLoss

    is_main = jax.process_index() == 0
    tcfg, rcfg = cfg["train"], cfg["run"]
    per_call = int(tcfg.get("steps_per_call", 1))
    if per_call > 1 and jax.process_count() > 1:
        raise config_lib.ConfigError(
            f"train.steps_per_call={per_call} must be 1 when several processes train together; "
            "set train.steps_per_call=1")
    checkpoint.check_directory(cfg)  # a file, read-only or full: refused before anything runs
    if is_main:
        print("# resolved config\n" + yaml.safe_dump(cfg, sort_keys=False), flush=True)
    model = build_model(cfg["model"], tcfg["seed"])
    plan = make_plan(cfg)
    trainer = fj.parallelize(model, make_optimizer(cfg), plan)
    if is_main and jax.process_count() > 1:
        print(f"# distributed: {distributed.describe(plan.mesh)}", flush=True)
    # Each process loads only the rows of the data-axis slice its devices own.
    train_it, val_it, items_per_step = build_data(cfg, model,
                                                  *distributed.data_shard(plan.mesh))
    val_batches = [next(val_it) for _ in range(tcfg["eval_batches"])]
    run_dir = Path(rcfg["dir"])
    bar = rcfg["progress"] == "bar" or (rcfg["progress"] == "auto" and sys.stdout.isatty())
    log = Logger(run_dir, is_main, bar, tcfg["steps"])
    ckpt = None
    try:
        if is_main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        n_dev = jax.device_count()
        flops = model_flops_per_step(cfg, model, cfg["data"]["batch_size"])
        peak = float(rcfg["peak_tflops"] or 0.0)

        def evaluate(state) -> float:
            if not val_batches:  # train.eval_batches=0: no validation, and nothing to compile
                return math.nan
            return float(np.mean([float(trainer.loss(state, b)) for b in val_batches]))

        # checkpoint.dir and resume: saving, resuming, SIGTERM/SIGINT (fiddlejax/checkpoint.py)
        ckpt = checkpoint.for_run(cfg, trainer, train_it, log.print)
        state, start = ckpt.start() if ckpt else (trainer.init(), 1)
        log.begin(start)
        first_val = evaluate(state)
        log.print(f"step {start - 1}: validation loss {first_val:.4f} "
                  f"(uniform guess: {uniform_loss(model):.4f})")
        times, losses, val = [], [], first_val
        t_prev = time.perf_counter()
        step, stop = start, False
        while step <= tcfg["steps"] and not stop:
            # One call runs k steps (several in one program: PipeDream-2BW's unflushed pipeline).
            k = min(per_call, tcfg["steps"] - step + 1)
            if k == 1:
                state, metrics = trainer.step(state, next(train_it))
                metrics = {name: [v] for name, v in metrics.items()}
            else:
                batches = [next(train_it) for _ in range(k)]
                state, metrics = trainer.steps(
                    state, {key: np.stack([b[key] for b in batches]) for key in batches[0]})
            step_losses = [float(x) for x in metrics["loss"]]  # syncs: time runs to completion
            bad = [i for i, x in enumerate(step_losses) if not math.isfinite(x)]
            if bad:  # stop before this state is logged as good or checkpointed
                raise NonFiniteLoss(step + bad[0], step_losses[bad[0]], _nan_hint(cfg, ckpt))
            now = time.perf_counter()
            dt, t_prev = (now - t_prev) / k, now
            for i, loss in enumerate(step_losses):
                s, last = step + i, i == k - 1
                if step > start:  # the first call compiles
                    times.append(dt)
                losses.append(loss)
                rec = {"loss": loss, "grad_norm": float(metrics["grad_norm"][i]),
                       "step_time_s": dt}
                rec.update(_throughput(dt, items_per_step, flops, n_dev, peak))
                eval_due = tcfg["eval_every"] and any(
                    (j % tcfg["eval_every"] == 0 or j == tcfg["steps"])
                    for j in range(step, s + 1))
                if last and eval_due:  # the state exists at the end of a call only
                    val = evaluate(state)
                    rec["val_loss"] = val
                    t_prev = time.perf_counter()  # evaluation is not step time
                stop = last and ckpt is not None and ckpt.after_step(s, state, rec)  # preempted
                line = None
                if s % tcfg["log_every"] == 0 or s == 1 or "val_loss" in rec:
                    line = _line(s, rec)
                log.log(s, rec, line)
            step += k
        if ckpt is not None:
            ckpt.close()
    finally:
        if ckpt is not None:
            ckpt.close(quiet=True)  # an error is on its way already: wait, release, stay quiet
        log.close()
    if is_main and losses:
        _summary(cfg, losses, times, val, first_val, items_per_step, flops, n_dev, peak, run_dir)
    return 0


def _nan_hint(cfg: dict, ckpt) -> str:
    where = ""
    if ckpt is not None:
        last = ckpt.last_good()
        where = (f"; the last checkpoint is step {last} in {cfg['checkpoint']['dir']} "
                 f"(resume=auto or resume={last} continues from it)" if last is not None else "")
    return (f"; stopped before saving it{where}. Lower optimizer.lr (now "
            f"{cfg['optimizer']['lr']}) or set plan.check_inputs=true to check the data")


def _throughput(dt: float, items: int, flops: float, n_dev: int, peak: float) -> dict:
    tflops = flops / dt / n_dev / 1e12
    out = {"tokens_per_s": items / dt, "tflops_per_device": tflops}
    if peak > 0:
        out["mfu"] = tflops / peak
    return out


def _line(step: int, r: dict) -> str:
    s = (f"step {step:5d} | loss {r['loss']:.4f} | {r['step_time_s'] * 1e3:7.1f} ms | "
         f"{r['tokens_per_s']:9.0f} tok/s | {r['tflops_per_device']:.4f} TFLOP/s/dev")
    if "mfu" in r:
        s += f" | MFU {100 * r['mfu']:.1f}%"
    if "val_loss" in r:
        s += f" | val {r['val_loss']:.4f}"
    return s


def _summary(cfg, losses, times, val, first_val, items, flops, n_dev, peak, run_dir) -> None:
    from rich.console import Console
    from rich.table import Table

    med = statistics.median(times) if times else float("nan")
    t = Table(title="fiddlejax train: summary")
    t.add_column("metric")
    t.add_column("value", justify="right")
    mesh = cfg["mesh"]
    t.add_row("layout", f"data={mesh['data']} pipe={mesh['pipe']} tensor={mesh['tensor']} "
                        f"schedule={cfg['plan']['schedule']}")
    t.add_row("steps", str(len(losses)))
    t.add_row("train loss (first -> last)", f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    t.add_row("validation loss (start -> end)", f"{first_val:.4f} -> {val:.4f}")
    t.add_row("median step time (excl. step 1)", f"{med * 1e3:.1f} ms")
    t.add_row("tokens/s" if cfg["model"]["name"] != "cnn" else "examples/s", f"{items / med:.0f}")
    t.add_row("TFLOP/s per device", f"{flops / med / n_dev / 1e12:.4f}")
    if peak > 0:
        t.add_row("MFU", f"{100 * flops / med / n_dev / 1e12 / peak:.1f}%")
    t.add_row("run directory", str(run_dir))
    Console().print(t)
    with open(run_dir / "summary.json", "w") as f:
        json.dump({"final_loss": losses[-1], "final_val_loss": val, "initial_val_loss": first_val,
                   "median_step_time_s": med, "steps": len(losses)}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main(None, sys.argv[1:]))
