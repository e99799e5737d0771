"""The job's config, declared once: every key of ``fiddlejax train`` with its default, its
meaning, what it accepts and the fix for a bad value.

Each section is a frozen dataclass whose fields are its keys; :class:`JobConfig` holds the
sections and the top-level keys. The rest derives from it: :func:`defaults` (what
:func:`fiddlejax.app.config.load` merges a user's file and overrides onto), the specs
``config.validate`` checks, ``fiddlejax/configs/default.yaml`` (:func:`default_yaml`), the
reference in docs/config.md, and the :class:`~fiddlejax.plan.Plan`, which takes every
``plan.<key>`` named like one of its fields. So a new key is one :func:`key` line here
(then ``python docs/hooks/build.py --write``). The job itself carries the config as a plain
dict, the YAML users write and a run's config.yaml records; :func:`typed` reads one into
these classes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import yaml

from fiddlejax import models
from fiddlejax.app.spec import COUNT, DIR, FRACTION, MESH_AXIS, POSITIVE, Spec

MAX_CPU_DEVICES = 4096  # simulated: 4096 start in ~10 s; 100000 hang for minutes or crash


@dataclasses.dataclass(frozen=True)
class Key:
    """One key's declaration beside its default (a dataclass field's metadata)."""

    meaning: str  # docs/config.md's meaning column and default.yaml's comment
    accepts: Spec | None  # None: its default's type (a null default: anything)
    fix: str | None  # the fix a bad value's error names; None: the default as an example
    name: str | None  # the config's name where Python's differs (``async``)


def key(default: Any, meaning: str, accepts: Spec | None = None, fix: str | None = None,
        name: str | None = None) -> Any:
    """A config key: a dataclass field with its :class:`Key` declaration."""
    meta = {"key": Key(meaning, accepts, fix, name)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# Names other modules own, read when a value is checked (importing them here would load the
# runtime for `fiddlejax --help`), so a kind registered there is accepted at once.
def _schedule_kinds() -> tuple:
    from fiddlejax.pipeline import schedules

    return tuple(schedules.kinds())


def _remat_policies() -> tuple:
    from fiddlejax.memory import policies

    return (*policies.POLICY_NAMES, "auto")


def _allreduce_algorithms() -> tuple:
    from fiddlejax import collectives

    return (*collectives.ALGORITHMS, "topk")


def section(cls: type) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The model: its family and dimensions, or a checkpoint to start from."""

    name: str = key("auto", "auto (gpt, or the family of model.from_pretrained's config.json),"
        " or any name in fiddlejax.models.NAMES", Spec(str, choices=models.NAMES))
    vocab_size: int | str = key("auto", "auto: the tokenizer's (data.tokenizer; bytes: 256),"
        " rounded up to a multiple of mesh.tensor; bert adds a [MASK] token",
        Spec(int, lo=2, words=("auto",)))
    seq_len: int = key(128, "tokens per sequence", POSITIVE)
    d_model: int = key(128, "hidden width", POSITIVE)
    n_heads: int = key(4, "attention heads (a multiple of mesh.tensor)", POSITIVE)
    n_layers: int = key(4, "blocks (cnn: residual conv blocks); at least mesh.pipe x"
        " plan.virtual_stages, best a multiple", POSITIVE)
    d_ff: int = key(512, "MLP width", POSITIVE)
    tie_embeddings: bool = key(False, "gpt, llama: the head reuses the token embedding")
    n_kv_heads: int = key(2, "llama: key/value heads (grouped-query attention; divides"
        " n_heads)", POSITIVE)
    rope_theta: float = key(10000.0, "llama: rotary embedding base",
        Spec(float, lo=0, open_lo=True))
    from_pretrained: str | None = key(None, "a Hugging Face directory to fine-tune (any family"
        " of docs/models.md), or a hub id in the local cache (org/name; nothing downloads); "
        "its config.json sets the family and dims", Spec(str, null=True))
    param_dtype: str = key("float32", "float32 | bfloat16: the parameters' own dtype (and, "
        "with AdamW, its moments'); bfloat16 halves the state, no float32 masters "
        "(docs/precision.md, 16-bit parameters); model.from_pretrained reads into it",
        Spec(str, choices=("float32", "bfloat16")))
    channels: int = key(32, "cnn only", POSITIVE)
    bias_update_speed: float = key(0.001, "deepseek_v3: loss-free balancing, each MoE layer's"
        " router bias moves by this per step towards balance (bias += speed x sign(mean load "
        "- load)); 0: the bias stays as loaded", Spec(float, lo=0))


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh: how many devices each parallel axis spans."""

    data: int = key(2, "data-parallel replicas; -1 uses the devices the other axes leave",
        MESH_AXIS, fix="a device count, or -1 to use the devices the other axes leave")
    pipe: int = key(2, "pipeline stages", MESH_AXIS)
    tensor: int = key(2, "tensor-parallel (Megatron) shards", MESH_AXIS)
    context: int = key(1, "sequence split (ring attention); seq_len a multiple of 2 x context",
        MESH_AXIS,
        fix="splits every sequence over this many devices (ring attention; seq_len a "
            "multiple of 2 x context)")
    expert: int = key(1, "MoE experts split (all-to-all); acts as data outside the MoE layers",
        MESH_AXIS)


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The parallel layout and memory plan: each key named like a field of
    :class:`~fiddlejax.plan.Plan` is that field."""

    schedule: str | None = key("interleaved-1f1b", "gpipe | 1f1b | interleaved-1f1b | zb-h1 |"
        " zb-v | interleaved-zb | 2bw | null (no pipeline)",
        Spec(str, null=True, choices=_schedule_kinds))
    microbatches: int = key(4, "per data-parallel replica and step", POSITIVE)
    virtual_stages: int | None = key(None, "model chunks per pipeline stage; null: 2 for"
        " interleaved kinds, else 1", Spec(int, lo=1, null=True))
    remat: str = key("none", "none | full | dots | dots_no_batch | minimal | offload | auto",
        Spec(str, choices=_remat_policies))
    memory_budget: Any = key(None, "remat=auto: bytes per device, e.g. 2GiB; null: 90% of the"
        " device's memory", fix="bytes per device, e.g. plan.memory_budget=2GiB")
    encodings: list | None = key([], "Gist activation encodings: relu-1bit, binarize, bf16,"
        " fp8, sparse[:capacity]", Spec(list, null=True))
    grad_allreduce: str = key("xla", "xla, a fiddlejax.collectives algorithm, or topk (no"
        " pipeline)", Spec(str, choices=_allreduce_algorithms))
    topk_density: float = key(0.01, "grad_allreduce=topk: fraction of each gradient leaf sent"
        " per step", Spec(float, lo=0, hi=1, open_lo=True))
    topk_on: str = key("gradients", "grad_allreduce=topk: gradients | updates (sparse"
        " optimizer updates)", Spec(str, choices=("gradients", "updates")))
    zero: int | str = key("auto", "0 | 1: shard the optimizer state over data (ZeRO-1) | 2:"
        " and the reduced gradients (ZeRO-2) | 3: also the parameters (FSDP) | auto: 3 with "
        "context > 1 and no pipeline, else 0",
        Spec(int, choices=(0, 1, 2, 3), words=("auto",)))
    fsdp_gather: str = key("layer", "zero=3: layer (gather each layer's weights per use) |"
        " step (a stage's once per step: faster, holds them)",
        Spec(str, choices=("layer", "step")))
    fsdp_prefetch: bool = key(True, "zero=3, gather=layer, no pipeline: gather layer i+1 while"
        " layer i computes (one more layer held)")
    compute_dtype: str = key("auto", "float32 | bfloat16 | float16 | auto (bfloat16 on"
        " GPU/TPU, float32 on CPU); weights stay float32",
        Spec(str, choices=("float32", "bfloat16", "float16", "auto")))
    matmul_dtype: str | None = key(None, "null (matmuls in compute_dtype) | fp8: layers' dense"
        " matmuls in float8 (e4m3, e5m2 gradients); with compute_dtype bfloat16 (auto picks "
        "it)", Spec(str, choices=("fp8",), null=True))
    rules: dict | None = key(None, "logical axis -> mesh axis over the defaults, e.g. {mlp:"
        " null, kv_heads: null}", Spec(dict, null=True),
        fix="logical axis name -> mesh axis, e.g. plan.rules={mlp: null, kv_heads: null}")
    partition: str = key("uniform", "layers to pipeline stages: uniform | params | cost",
        Spec(str, choices=("uniform", "params", "cost")))
    check_inputs: bool = key(False, "check token ids against the vocabulary and the loss for"
        " NaN every step")
    sequence_parallel: bool = key(False, "Megatron-SP: norms and the residual stream split"
        " over tensor along the sequence")
    unroll_layers: bool | None = key(None, "no pipeline: true (layers as straight-line code) |"
        " false (a scan) | null: unrolled off the CPU unless zero=3", Spec(bool, null=True))
    lora: dict | None = key(None, "LoRA adapters on a frozen base, e.g. {rank: 16, alpha: 32,"
        " dropout: 0, targets: [wq, wk, wv, wo, w1, w3, w2]} (plan.lora.rank=16: the rest "
        "default; dropout: peft's lora_dropout on the adapters' input, masks per example, the"
        " same on every layout); null: full fine-tune", Spec(dict, null=True))


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """The optimizer and its learning-rate schedule."""

    name: str = key("adamw", "adamw | muon (Muon on the blocks' matrices, Nesterov AdamW at lr"
        " elsewhere)", Spec(str, choices=("adamw", "muon")))
    lr: float = key(0.003, "peak learning rate (warm-up, then cosine decay to 10% over"
        " train.steps)", Spec(float, lo=0, open_lo=True))
    muon_lr: float = key(0.02, "optimizer.name=muon: peak learning rate of the Muon matrices",
        Spec(float, lo=0, open_lo=True))
    warmup_steps: int = key(30, "linear warm-up from 0", COUNT)
    weight_decay: float = key(0.1, "decoupled (AdamW)", Spec(float, lo=0))
    b1: float = key(0.9, "first-moment decay", FRACTION)
    b2: float = key(0.95, "second-moment decay", FRACTION)
    nesterov: bool = key(False, "AdamW with Nesterov momentum (NAdamW)")
    stale_correction: float = key(0, "plan.schedule=2bw: fj.stale_correction's alpha (0 = off,"
        " 1 = full)", Spec(float, lo=0, hi=1))
    clip: float = key(1.0, "global gradient-norm clip; 0 = off", Spec(float, lo=0))


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The training data, its tokenizer and how documents become rows."""

    batch_size: int = key(32, "global, per step", POSITIVE)
    seed: int = key(0, "data shuffling (and mixing)", COUNT)
    path: Any = key(None, "your data: a file, directory or glob (or a list) of .txt,"
        " .jsonl(.gz), .parquet, .arrayrecord, .bin/.npy, or a save_to_disk directory; null: "
        "the stdlib corpus")
    field: str = key("text", "the text field of .jsonl, .parquet, Arrow and ArrayRecord"
        " records")
    format: str = key("auto", "text | chat (records of messages, or prompt and completion:"
        " rendered with the chat template, loss on the assistant's tokens) | preference "
        "(prompt, chosen, rejected: DPO, see train.dpo_beta) | auto (chat or preference when "
        "the first record is)")
    chat_template: str | None = key(None, "data.format=chat: a jinja file (or text) instead of"
        " the tokenizer's chat template", Spec(str, null=True))
    tokenizer: str = key("auto", "auto (model.from_pretrained's own, else bytes) | bytes | a"
        " tokenizer.json | a sentencepiece tokenizer.model | a directory holding one")
    pack: bool = key(True, "pack documents into rows (segment_ids, positions); false: a"
        " document per row, padded (padding out of the loss)")
    mixture: Any = key(None, "instead of data.path: [{path: A, weight: 0.7}, {path: B, weight:"
        " 0.3}]")
    val_path: Any = key(None, "validation documents; else data.val_fraction of the documents,"
        " by hash")
    val_fraction: float | None = key(None, "share of documents held out for validation; null:"
        " 0.05 (without data.val_path)",
        Spec(float, lo=0, hi=1, open_lo=True, open_hi=True, null=True))
    eos_id: int | None = key(None, ".bin/.npy token files: the id that ends each document",
        Spec(int, lo=0, null=True))
    token_dtype: str = key("uint16", ".bin token files: uint16 | uint32",
        Spec(str, choices=("uint16", "uint32")))
    workers: int = key(0, "tokenizer processes per job process while preparing a corpus store;"
        " 0: tokenize in this process", COUNT)
    cache_dir: str | None = key(None, "prepared corpus stores (made once, reused); null:"
        " $FIDDLEJAX_DATA_CACHE, else ~/.cache/fiddlejax/data",
        Spec(str, null=True, empty=False))
    allow_change: bool = key(False, "resume on other data or another tokenizer than the"
        " checkpoint's")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The training loop."""

    steps: int = key(150, "optimizer steps (also sets the learning-rate schedule)", POSITIVE)
    log_every: int = key(25, "steps between terminal lines", POSITIVE)
    eval_every: int = key(50, "steps between validation losses; 0 = none during training",
        COUNT)
    eval_batches: int = key(8, "validation batches per evaluation; 0 = none", COUNT)
    steps_per_call: int = key(1, "optimizer steps per jitted call (plan.schedule=2bw: K steps"
        " unflushed)", POSITIVE)
    seed: int = key(0, "model initialization", COUNT)
    nonfinite: str = key("skip", "a step whose loss or gradient norm is NaN/inf: skip (its"
        " update is not applied, counted) | stop (the job ends)",
        Spec(str, choices=("skip", "stop")))
    nonfinite_limit: int = key(5, "nonfinite=skip: the job stops after this many skipped steps"
        " in a row", POSITIVE)
    dpo_beta: float = key(0.1, "preference data (DPO): beta of the loss -log sigmoid(beta *"
        " ((pi_c - ref_c) - (pi_r - ref_r)))", Spec(float, lo=0, open_lo=True))


@dataclasses.dataclass(frozen=True)
class RunSection:
    """Where the run writes, and on what devices."""

    dir: str = key("runs/default", "metrics.jsonl, TensorBoard events, config.yaml,"
        " summary.json, checkpoints/", Spec(str, empty=False),
        fix="the directory for logs and checkpoints, e.g. run.dir=runs/default")
    cpu_devices: int = key(8, "simulated CPU devices when running on the CPU",
        Spec(int, lo=0, hi=MAX_CPU_DEVICES),
        fix=f"0 (real devices) or up to {MAX_CPU_DEVICES}, e.g. run.cpu_devices=8")
    peak_tflops: float = key(0.0, "per device, for MFU; 0 = unknown (MFU not shown)",
        Spec(float, lo=0))
    progress: str = key("auto", "auto | bar | lines",
        Spec(str, choices=("auto", "bar", "lines")))
    compile_cache: str | None = key("auto", "compiled programs kept for the next start; auto:"
        " $JAX_COMPILATION_CACHE_DIR, else ~/.cache/fiddlejax/xla; or a directory; null: none",
        DIR)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """When and where checkpoints are saved, and which are kept."""

    dir: str | None = key("auto", "auto: <run.dir>/checkpoints; or a directory; null: no"
        " checkpoints (resume=auto continues from it)", DIR,
        fix="checkpoint.dir=auto saves under run.dir/checkpoints, checkpoint.dir=DIR in "
            "DIR, checkpoint.dir=null saves nothing")
    every: int | str = key("auto", "steps between saves, or auto: CheckFreq picks it from"
        " measured costs", Spec(int, lo=1, words=("auto",)),
        fix="a step count such as checkpoint.every=100, or checkpoint.every=auto "
            "(CheckFreq picks it)")
    checkfreq_overhead: float = key(0.035, "CheckFreq's budget: share of training time spent"
        " checkpointing", Spec(float, lo=0, hi=1, open_lo=True, open_hi=True))
    max_to_keep: int | None = key(3, "latest checkpoints kept", Spec(int, lo=1, null=True))
    best_metric: str | None = key(None, "also keep the best checkpoint by this metric, e.g."
        " val_loss", Spec(str, null=True))
    best_mode: str = key("min", "min | max", Spec(str, choices=("min", "max")))
    async_: bool = key(True, "write in the background after a device-to-host snapshot",
        name="async")  # a Python keyword
    snapshot_gb: float | None = key(None, "host GB a save's snapshot holds at once per process"
        " (at least the largest array; a save then waits on its writes); null: the whole state",
        Spec(float, lo=0, open_lo=True, null=True),
        fix="a size in GB such as checkpoint.snapshot_gb=2, or null for the whole snapshot")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A whole job: the sections, then the keys at the top level."""

    model: ModelSection = section(ModelSection)
    mesh: MeshSection = section(MeshSection)
    plan: PlanSection = section(PlanSection)
    optimizer: OptimizerSection = section(OptimizerSection)
    data: DataSection = section(DataSection)
    train: TrainSection = section(TrainSection)
    run: RunSection = section(RunSection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    resume: int | str | None = key(None, "null | auto | a step number",
        Spec(int, lo=1, null=True, words=("auto",)),
        fix="resume=auto continues from the latest checkpoint, resume=N from step N")
    init_from: str | None = key(None, "weights only (fresh optimizer, step 0) from a fiddlejax"
        " run or checkpoint directory, or a Hugging Face directory", Spec(str, null=True))


def entries(cls: type = JobConfig, where: str = "") -> Iterator[tuple[str, Any, Key]]:
    """``(dotted name, default, Key)`` for every key, in declaration order."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from entries(f.metadata["section"], f"{where}{f.name}.")
            continue
        k = f.metadata["key"]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        yield f"{where}{k.name or f.name}", default, k


def defaults() -> dict:
    """The default config as the nested dict a job reads."""
    out: dict = {}
    for dotted, default, _ in entries():
        *parents, leaf = dotted.split(".")
        d = out
        for part in parents:
            d = d.setdefault(part, {})
        d[leaf] = default
    return out


def typed(cfg: dict, cls: type = JobConfig) -> Any:
    """A config dict (``config.load``'s) as :class:`JobConfig`: ``typed(cfg).train.steps``."""
    kw = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            kw[f.name] = typed(cfg[f.name], f.metadata["section"])
        else:
            kw[f.name] = cfg[f.metadata["key"].name or f.name]
    return cls(**kw)


def as_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def default_yaml() -> str:
    """``fiddlejax/configs/default.yaml``: every key with its default and its meaning."""
    lines = ["# fiddlejax train: defaults. Override any key with key=value (dotted), e.g. "
             "mesh.data=2 train.steps=50",
             "# Generated from fiddlejax/app/schema.py by python docs/hooks/build.py --write: "
             "edit there"]
    parents: list[str] = []
    for dotted, default, k in entries():
        *path, leaf = dotted.split(".")
        same = next((i for i, (a, b) in enumerate(zip(parents, path)) if a != b),
                    min(len(parents), len(path)))
        lines += [f"{'  ' * i}{path[i]}:" for i in range(same, len(path))]
        parents = path
        text = f"{'  ' * len(path)}{leaf}: {as_yaml(default)}"
        lines.append(f"{text.ljust(21)}  # {k.meaning}")
    return "\n".join(lines) + "\n"
