"""``fiddlejax export RUN_DIR OUT_DIR``: a decoder run's checkpoint (any family of
``fiddlejax.models.HF_FAMILIES``: Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, Mixtral,
Qwen3-MoE, DeepSeek-V3) as a Hugging Face directory of its family (a GPT run's as a Hugging
Face ``gpt2`` one, :mod:`fiddlejax.models.gpt2_hf`).

The run is rebuilt exactly as ``fiddlejax train`` built it (its ``config.yaml``: model, optimizer,
plan and simulated devices), abstractly; its checkpoint's parameters (never the optimizer
state) restore one leaf at a time onto one device (a checkpoint restores onto any layout),
verified array by array (:mod:`fiddlejax.checkpoint.params`), and the model's
``save_pretrained`` writes them tensor by tensor as ``config.json`` + safetensors (host memory:
about one leaf and one tensor), beside the job's tokenizer files and
``generation_config.json`` (:mod:`fiddlejax.data.tokenizer_files`). Everything is written
into a temporary directory first and swapped into place when complete; the target's other
files are kept (:mod:`fiddlejax.app.export_dir`).

Launched as several processes (``launch/local.py``, SLURM, Kubernetes: as ``fiddlejax train``),
the export joins the job (:func:`fiddlejax.distributed.initialize`) and stores the parameters
split over every process's devices (zero=3 over ``data``): each process restores only its
shards of each leaf, every one takes part in gathering one tensor at a time, and process 0
writes the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fiddlejax import models
from fiddlejax.app import beside_writer, export_dir, runs


def export(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
           checkpoint_dir: str | Path | None = None, max_shard_size: int | str = "5GB",
           dtype: str | None = None, overwrite: bool = False, adapter: bool = False) -> int:
    """Write checkpoint ``step`` (default: the latest) of the run in ``run_dir`` to ``out_dir``
    in Hugging Face's layout of the run's family; returns the step written. ``dtype``: None
    writes the dtype of the checkpoint the run started from (float32 from scratch).
    ``overwrite``: replace files in ``out_dir`` that no earlier export wrote (else refused).
    ``adapter``: a ``plan.lora`` run's adapters alone, as a PEFT adapter directory
    (``adapter_model.safetensors`` + ``adapter_config.json``) for the run's base."""
    from fiddlejax.app.config import parse_bytes

    # the arguments first: a restore takes a minute at size
    max_shard_size = parse_bytes(max_shard_size, "--max-shard-size")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"OUT_DIR {out_dir} is a file; pass a directory to write")
    run_dir = Path(run_dir)
    cfg = runs.run_config(run_dir)
    ckpt = _checked(cfg, run_dir, out_dir, checkpoint_dir, overwrite, adapter)
    from fiddlejax.app import build

    build.setup_devices(cfg)
    from fiddlejax import distributed

    try:  # joins a multi-process job (SLURM, Open MPI, Kubernetes, launch/local.py); else no-op
        distributed.initialize()
    except RuntimeError as e:  # start-up problems name their fix: bad input, exit 2
        raise ValueError(str(e)) from e
    import fiddlejax as fj
    from fiddlejax.checkpoint import params as checkpoint_params

    model = build.build_model(cfg["model"], cfg["train"]["seed"], weights=False,  # restored
                              lora=cfg["plan"].get("lora"))
    import jax  # a checkpoint restores onto any layout (_reading_plan's)

    trainer = fj.parallelize(model, build.make_optimizer(cfg), _reading_plan())
    mgr = fj.CheckpointManager(ckpt, trainer, read_only=True)  # a reader: never deletes
    from fiddlejax.data import tokenizer, tokenizer_files

    # the job's tokenizer (model.from_pretrained's own unless data.tokenizer named another)
    tok = tokenizer.load(cfg["data"].get("tokenizer", "auto"),
                         cfg["model"].get("from_pretrained"))
    c = model.config
    if adapter and (getattr(c, "model_type", "") == "phi3" or cfg["model"]["name"] == "gpt"):
        raise ValueError(f"--adapter: {getattr(c, 'model_type', cfg['model']['name'])} stores "
                         "its projections fused or under other names than PEFT's targets here; "
                         "export the merged model (without --adapter)")
    def write(reader, want: int) -> int:  # the parameters only, one leaf at a time
        step, shapes, leaves = checkpoint_params.param_leaves(reader, want)
        leaf = leaves
        if jax.process_index() != 0:  # takes part in the gathers; process 0 writes
            take_part(model, shapes, leaf, dtype)
            return step
        if adapter:
            with export_dir.staged(out_dir, overwrite, run=str(run_dir.absolute()),
                                   step=step) as tmp:
                write_adapter(tmp, shapes, leaf, cfg)
                leaves.check()
            return step
        if cfg["plan"].get("lora") is not None:  # the base with the adapters folded in
            from fiddlejax.finetune import lora

            shapes, leaf = lora.merged_leaves(shapes, leaf,
                                              build.lora_settings(cfg["plan"]["lora"]).scale)
        with export_dir.staged(out_dir, overwrite, run=str(run_dir.absolute()), step=step) as tmp:
            models.save_hf(model, tmp, max_shard_size=max_shard_size, dtype=dtype,  # GPT: gpt2
                           leaves=(shapes, leaf))
            leaves.check()  # every leaf read checked whole before the export is in place
            tokenizer_files.save(tmp, tok, getattr(c, "max_position_embeddings", None)
                                 or getattr(c, "seq_len", None))
        return step

    try:  # a live job deleting the step being read: again at its newer latest
        return beside_writer.read(mgr, step, write)
    finally:
        mgr.close()


def _checked(cfg: dict, run_dir: Path, out_dir, checkpoint_dir, overwrite: bool,
             adapter: bool) -> Path:
    """The run's checkpoint directory, once the export's arguments are known to fit the run
    (before anything is read: a restore takes a minute at size)."""
    if cfg["model"]["name"] not in models.DECODERS:
        raise ValueError(f"{run_dir} trained model.name={cfg['model']['name']!r}, which has no "
                         "Hugging Face twin here; export writes the decoder families "
                         f"({', '.join(models.HF_FAMILIES)}) as themselves and GPT runs as "
                         "gpt2 directories")
    if adapter and cfg["plan"].get("lora") is None:
        raise ValueError(f"{run_dir} trained no LoRA adapters (plan.lora was null); --adapter "
                         "writes a PEFT adapter of a plan.lora run: export without it")
    ckpt = runs.checkpoint_dir(cfg, run_dir, checkpoint_dir)
    export_dir.check_target(out_dir, overwrite)  # before anything is read
    from fiddlejax.distributed import detect

    if detect().is_multiprocess and (adapter or cfg["plan"].get("lora") is not None
                                     or cfg["model"]["name"] == "gpt"):
        raise ValueError(f"{run_dir}: a GPT run, a plan.lora run and --adapter export from one "
                         "process (their leaves are merged or written whole on the host); "
                         "run `fiddlejax export` without the launcher")
    return ckpt


def _reading_plan():
    """One device restores the whole checkpoint; in a multi-process job each process restores
    its shards (zero=3 over every device)."""
    import jax

    import fiddlejax as fj

    if jax.process_count() == 1:
        return fj.Plan(mesh=fj.make_mesh(data=1, pipe=1, tensor=1, devices=jax.devices()[:1]))
    return fj.Plan(mesh=fj.make_mesh(data=jax.device_count(), pipe=1, tensor=1), zero=3)


def take_part(model, shapes: dict, leaf, dtype: str | None) -> None:
    """What a process other than 0 does in a multi-process export: restore its shards of each
    leaf and take part in gathering them, tensor by tensor in process 0's order, writing
    nothing (a decoder's ``save_pretrained`` writes on process 0 only)."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:  # stays empty
        models.save_hf(model, scratch, dtype=dtype, leaves=(shapes, leaf))


def write_adapter(directory: Path, shapes: dict, leaf, cfg: dict) -> None:
    """A PEFT adapter of the run's adapters (:func:`fiddlejax.finetune.lora.peft_adapter`)."""
    import json

    from safetensors.numpy import save_file

    from fiddlejax.app import build
    from fiddlejax.finetune import lora

    tensors, config = lora.peft_adapter(shapes, leaf, build.lora_settings(cfg["plan"]["lora"]),
                                        cfg["model"].get("from_pretrained"))
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="fiddlejax export",
        description="Write a trained decoder's (llama, mistral, qwen2, qwen3, phi3, gemma, "
                    "gemma2, gemma3_text; GPT: gpt2) checkpoint as a Hugging Face directory "
                    "(config.json + safetensors, the tokenizer's files and "
                    "generation_config.json) that transformers' AutoTokenizer and "
                    "AutoModelForCausalLM load.")
    p.add_argument("run_dir", help="the run.dir of a `fiddlejax train` run of a decoder")
    p.add_argument("out_dir", help="directory to write")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--checkpoint-dir", help="default: the run's checkpoint.dir")
    p.add_argument("--max-shard-size", default="5GB",
                   help="split the weights into files of at most this size (default 5GB)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: the dtype of model.from_pretrained's checkpoint (float32 "
                        "for a model trained from scratch)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files in OUT_DIR that no earlier export wrote (config.json, "
                        "model*.safetensors, tokenizer files); its other files are always kept")
    p.add_argument("--adapter", action="store_true",
                   help="a plan.lora run: write its adapters as a PEFT adapter "
                        "(adapter_model.safetensors + adapter_config.json) for its base, "
                        "instead of the merged model")
    args = p.parse_args(argv)
    from fiddlejax import distributed

    code = _export_command(args)
    distributed.goodbye(code)  # a multi-process job: the others learn this one ends on purpose
    return code


def _export_command(args: argparse.Namespace) -> int:
    try:
        step = export(args.run_dir, args.out_dir, step=args.step,
                      checkpoint_dir=args.checkpoint_dir, max_shard_size=args.max_shard_size,
                      dtype=args.dtype, overwrite=args.overwrite, adapter=args.adapter)
    except export_dir.ExportFailed as e:  # like a failed checkpoint save: a failure, exit 1
        print(f"fiddlejax export: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as e:
        print(f"fiddlejax export: {e}", file=sys.stderr)
        return 2
    import jax

    if jax.process_index() != 0:  # process 0 wrote (and reports) the directory
        return 0
    files = export_dir.recorded(args.out_dir)
    print(f"exported step {step} of {args.run_dir} to {args.out_dir}: {', '.join(files)}")
    return 0
