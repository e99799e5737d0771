"""A trained run's model, or a Hugging Face directory's, with its weights and tokenizer: what
``fiddlejax eval``, ``fiddlejax generate``, ``fiddlejax export`` and ``init_from`` load.

A run is rebuilt as ``fiddlejax train`` built it (its ``config.yaml``) and its checkpoint
restores through the :class:`~fiddlejax.checkpoint.CheckpointManager`, onto any layout, so
``init_from`` can load a run saved on another layout into this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fiddlejax.app import beside_writer
from fiddlejax.app.config import AUTO_CHECKPOINT_DIR


def run_config(run_dir: str | Path) -> dict:
    """The resolved config a ``fiddlejax train`` run wrote (``config.yaml``)."""
    p = Path(run_dir) / "config.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.yaml; pass the run.dir of a "
                                "`fiddlejax train` run")
    try:
        cfg = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # a python/* tag, a damaged file
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{p} is not a config fiddlejax wrote{at}: "
                         f"{getattr(e, 'problem', None) or e}; fiddlejax reads plain YAML only: "
                         "fix the file, or pass another run.dir") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} is not a config fiddlejax wrote (not a mapping of sections); "
                         "pass the run.dir of a `fiddlejax train` run")
    return cfg


def checkpoint_dir(cfg: dict, run_dir: Path, given: str | Path | None = None) -> Path:
    """Where the run's checkpoints are now (``checkpoint.dir``, or the run's own)."""
    ckpt = given or cfg["checkpoint"]["dir"]
    if not ckpt:
        raise ValueError(f"{run_dir} saved no checkpoints (checkpoint.dir was null); train with "
                         "checkpoint.dir=auto (the default) or DIR, or pass --checkpoint-dir")
    if ckpt == AUTO_CHECKPOINT_DIR:  # the run's own: wherever the run directory is now
        ckpt = run_dir / "checkpoints"
    ckpt = Path(ckpt)
    if not ckpt.is_dir() and not ckpt.is_absolute() and (run_dir / ckpt).is_dir():
        ckpt = run_dir / ckpt  # a relative checkpoint.dir, seen from the run directory
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist; pass "
                                "--checkpoint-dir")
    return ckpt


def restore(run_dir: str | Path, *, step: int | None = None,
            checkpoint_dir_: str | Path | None = None, plan=None):
    """``(cfg, model, step)``: the run's model with the weights of checkpoint ``step`` (default
    the latest), restored onto ``plan`` (default: one device)."""
    from flax import nnx

    import fiddlejax as fj
    from fiddlejax.app import build

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    ckpt = checkpoint_dir(cfg, run_dir, checkpoint_dir_)
    model = build.build_model(cfg["model"], cfg["train"]["seed"], weights=False,  # restored
                              lora=cfg["plan"].get("lora"))
    if plan is None:  # one device: checkpoints restore onto any layout
        import jax

        plan = fj.Plan(mesh=fj.make_mesh(data=1, pipe=1, tensor=1, devices=jax.devices()[:1]))
    trainer = fj.parallelize(model, build.make_optimizer(cfg), plan)
    mgr = fj.CheckpointManager(ckpt, trainer, read_only=True)  # a reader: never deletes
    try:
        restored = beside_writer.read(mgr, step, lambda m, s: m.restore_all(s))
    finally:
        mgr.close()
    nnx.update(model, trainer.params(restored.state))
    return cfg, model, restored.step


def is_run(path: str | Path) -> bool:
    return (Path(path) / "config.yaml").is_file()


def is_hf(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def init_weights(cfg: dict, model, plan) -> tuple[str | None, Any]:
    """``init_from=DIR``: copy a run's (latest checkpoint) weights into ``model``, or check a
    Hugging Face directory's against it and return their loader (``trainer.init`` takes it:
    each process reads the slices its devices hold, as ``model.from_pretrained`` does); the
    optimizer and the step start fresh. Returns ``(what was loaded, loader or None)``."""
    src = cfg.get("init_from")
    if not src:
        return None, None
    from flax import nnx

    if is_run(src):
        _, donor, step = restore(src, plan=plan)
        what = f"{src} (step {step})"
    elif is_hf(src):
        from fiddlejax import models

        donor = models.from_pretrained(src, seq_len=cfg["model"]["seq_len"],  # any family
                                       abstract=True)  # shapes now, slices at init
        what = f"{src} (Hugging Face)"
    else:
        raise ValueError(f"init_from={src} is neither a fiddlejax run directory (config.yaml) "
                         "nor a Hugging Face directory (config.json); give one of them")
    mine, theirs = nnx.state(model, nnx.Param), nnx.state(donor, nnx.Param)
    a = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(mine)}
    b = {"/".join(map(str, k)): v.shape for k, v in nnx.to_flat_state(theirs)}
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:3]
        raise ValueError(
            f"init_from={src} has other weights than this model: "
            + "; ".join(f"{k}: {b.get(k)} there, {a.get(k)} here" for k in diff)
            + ". Use the same model.* settings as the run that saved it")
    if is_hf(src):
        return what, donor.pretrained_params
    nnx.update(model, theirs)
    return what, None
