"""A config, as the job builds it: devices, model, data, plan and optimizer.

Per-model knowledge (how to build, feed and count FLOPs, which matrices Muon orthogonalizes)
lives with the models, in ``models.REGISTRY``; this module only reads the config.
"""

from __future__ import annotations

import dataclasses

from fiddlejax import models
from fiddlejax.app import config as config_lib


def setup_devices(cfg: dict) -> dict[str, str]:
    """Simulate ``run.cpu_devices`` CPU devices and, when the backend will be a GPU, set the
    recommended XLA flags (:mod:`fiddlejax.app.xla_flags`); must run before JAX starts its
    backends, and turns on the compile cache (``run.compile_cache``). Returns the XLA flags
    it added."""
    from fiddlejax.app import compile_cache, xla_flags

    added = xla_flags.apply(fp8=cfg["plan"].get("matmul_dtype") == "fp8")
    compile_cache.use(cfg["run"].get("compile_cache", "auto"))
    n = int(cfg["run"]["cpu_devices"] or 0)
    if n > 0:
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # JAX already runs in this process (a notebook, a test): its
            pass              # devices serve, and the mesh is checked against them
    return added


def entry(cfg: dict) -> models.ModelEntry:
    """The registry entry of ``model.name``."""
    return models.get(cfg["model"]["name"])


def resolve_data(cfg: dict) -> None:
    """Check that ``data:`` fits the model and resolve ``model.vocab_size=auto`` to the
    tokenizer's size (rounded up to a multiple of ``mesh.tensor``), in ``cfg`` itself, before
    anything is built; reading the tokenizer may raise a ``DataError`` naming the file."""
    from fiddlejax.data import pipeline, tokenizer

    m, d = cfg["model"], cfg["data"]
    pipeline.components(d)  # data.mixture's weights, before anything is read
    if m["name"] not in models.DECODERS and pipeline.wanted(d, m.get("from_pretrained")):
        raise config_lib.ConfigError(
            f"data.path, data.mixture and data.tokenizer feed the decoders; model.name="
            f"{m['name']} trains on its bundled data: use model.name=gpt or llama, or unset them")
    source = m.get("from_pretrained")
    # bytes for a larger vocabulary: refused, unless named
    if source and m["name"] in models.DECODERS:
        tokenizer.check_bytes(d.get("tokenizer", "auto"), source,
                              pretrained_config(source).get("vocab_size"))
    if m["vocab_size"] == "auto":
        tok = tokenizer.load(d.get("tokenizer", "auto"), source)
        m["vocab_size"] = tokenizer.vocab_size(tok, max(int(cfg["mesh"]["tensor"]), 1))


def build_model(mcfg: dict, seed: int, weights: bool = True, lora: dict | None = None):
    """The model of the config's ``model:`` section, initialized from ``seed``
    (``vocab_size=auto`` without :func:`resolve_data`: the default tokenizer's size).
    ``weights=False``: a ``model.from_pretrained`` model stays abstract (shapes only), for
    :func:`initial_params` to load by shards or a checkpoint to restore into. ``lora``
    (``plan.lora``): adapters added (:mod:`fiddlejax.finetune.lora`); a pretrained base then loads
    whole, before them."""
    if lora is not None:
        from fiddlejax.finetune import lora as lora_

        settings = lora_settings(lora)
        return lora_.add(build_model(mcfg, seed, weights=True), settings, seed)
    name = mcfg["name"]
    if mcfg.get("from_pretrained") and name not in models.HF_FAMILIES:
        raise ValueError(f"model.from_pretrained={mcfg['from_pretrained']!r} needs "
                         "model.name=llama, another Hugging Face family "
                         f"({', '.join(models.HF_FAMILIES)})"
                         f" or auto (its config.json's family); got {name!r}")
    try:
        model = models.with_param_dtype(models.get(name).build(mcfg, seed),
                                        mcfg.get("param_dtype"))
        loader = initial_params(model)
        if weights and loader is not None:
            from flax import nnx

            nnx.update(model, loader(None))
        return model
    except Exception as e:  # a damaged Hugging Face file: name it, not the parser's words
        from fiddlejax.app.guards import pretrained_error

        source = mcfg.get("from_pretrained")
        clear = pretrained_error(source, e) if source else None
        if clear is None:
            raise
        raise clear from e


def lora_settings(value: dict):
    """``plan.lora`` as :class:`fiddlejax.finetune.lora.LoRA`, its keys checked."""
    from fiddlejax.finetune import lora as lora_

    known = ("rank", "alpha", "dropout", "targets")
    if not isinstance(value, dict) or set(value) - set(known):
        raise ValueError(f"plan.lora={value!r}: give a mapping of {', '.join(known)}, e.g. "
                         "plan.lora.rank=16 (alpha defaults to 2 x rank)")
    kw = dict(value)
    if "targets" in kw:
        kw["targets"] = lora_.targets_of(kw["targets"])
    kw.setdefault("alpha", 2.0 * kw.get("rank", 16))
    return lora_.LoRA(**kw)


def initial_params(model):
    """The loader of a ``model.from_pretrained`` model still abstract (``trainer.init`` takes
    it: each process reads the slices its devices hold), else None (the model's weights)."""
    import jax

    if getattr(model, "pretrained_from", None) is None:
        return None
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return model.pretrained_params if any(isinstance(x, jax.ShapeDtypeStruct)
                                          for x in leaves) else None


def build_data(cfg: dict, model, process_index: int = 0,
               process_count: int = 1) -> models.Batches:
    """This process's train and validation streams (its rows of each global batch)."""
    return entry(cfg).batches(cfg, model, process_index, process_count)


def compute_dtype(name: str, matmul: str | None = None) -> str:
    """``plan.compute_dtype``: ``auto`` is bfloat16 on accelerators, float32 on the CPU (whose
    XLA upcasts bf16 matmuls, so it would only lose precision); bfloat16 with fp8 matmuls,
    the only compute dtype they run with."""
    if name != "auto":
        return name
    if matmul == "fp8":
        return "bfloat16"
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def zero_level(zero, mesh, schedule) -> int:
    """``plan.zero``; ``auto`` (the default) is 3 when sequences are split over ``context``
    without a pipeline, else 0. Context replicas hold the same parameters: unsharded, each
    device kept whole weights and AdamW's moments (4x MaxText's at context=4, which shards
    them over data x context); FSDP over data x context holds 1/N of them."""
    if zero != "auto":
        return zero
    context = dict(zip(mesh.axis_names, mesh.devices.shape)).get("context", 1)
    return 3 if context > 1 and schedule is None else 0


def make_plan(cfg: dict):
    """The :class:`~fiddlejax.plan.Plan` of the config's ``mesh:`` and ``plan:`` sections."""
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
    rules = {k: tuple(v) if isinstance(v, list) else v for k, v in (p.get("rules") or {}).items()}
    # Every plan.<key> named like a Plan field is that field (a new one needs no line here);
    # only the keys whose job form differs from the field's are converted.
    fields = {f.name for f in dataclasses.fields(fj.Plan)} - {"mesh"}
    return fj.Plan(mesh=mesh, **{k: v for k, v in p.items() if k in fields} | dict(
        zero=zero_level(p["zero"], mesh, p["schedule"]), virtual_stages=virtual,
        encodings=tuple(p["encodings"] or ()), memory_budget=budget,
        compute_dtype=compute_dtype(p.get("compute_dtype", "float32"), p.get("matmul_dtype")),
        rules=rules))


def model_layers(model) -> int | None:
    """How many layers the model stacks (GPT, BERT, CNN: ``n_layers``; Llama:
    ``num_hidden_layers``, which a Hugging Face checkpoint sets; DeepSeek-V3 less its
    ``first_k_dense_replace`` dense layers, which run in the first stage's prologue)."""
    c = getattr(model, "config", None)
    for name in ("n_layers", "num_hidden_layers"):
        value = getattr(c, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value - getattr(c, "first_k_dense_replace", 0)
    return None


def check_layout(cfg: dict, model, plan) -> None:
    """Refuse a pipeline with more chunks than the model has layers, before anything compiles,
    naming the job's keys and values that fix it (each chunk runs at least one layer)."""
    layers = model_layers(model)
    if plan.schedule is None or layers is None:
        return
    pipe, virtual = int(plan.mesh.shape["pipe"]), int(plan.virtual_stages)
    chunks = pipe * virtual
    if layers >= chunks:
        return
    p, source = cfg["plan"], cfg["model"].get("from_pretrained")
    less = ", less first_k_dense_replace" if getattr(model.config, "first_k_dense_replace",
                                                     0) else ""
    what = (f"the model of model.from_pretrained={source} has {layers} layers "
            f"(num_hidden_layers in its config.json{less}), which" if source
            else f"model.n_layers={layers}")
    auto = f" (automatic for {p['schedule']})" if p["virtual_stages"] is None else ""
    fixes = []
    if virtual > 1 and layers >= pipe:
        single = "plan.virtual_stages=1" + (" plan.schedule=1f1b" if p["schedule"] == "zb-v"
                                            else "")
        fixes.append(f"{single} ({pipe} chunks)")
    data = cfg["mesh"]["data"]
    no_pipe = ["mesh.pipe=1"] + ([f"mesh.data={data * pipe}"] if data > 0 else [])
    no_pipe += ["plan.schedule=null"] + (["plan.virtual_stages=1"] if p["virtual_stages"] not in
                                         (None, 1) else [])
    fixes.append(" ".join(no_pipe) + " (no pipeline)")
    if not source:
        fixes.append(f"model.n_layers={chunks} or more")
    raise config_lib.ConfigError(
        f"{what} cannot be split over mesh.pipe={pipe} x plan.virtual_stages={virtual}{auto} = "
        f"{chunks} pipeline chunks (each chunk needs a layer); set " + ", or ".join(fixes))


# The one-chunk-per-stage schedule nearest each interleaved kind.
SINGLE_CHUNK = {"interleaved-1f1b": "1f1b", "interleaved-zb": "zb-h1", "zb-v": "zb-h1"}


def explicit_keys(path: str | None, overrides: list[str]) -> set[str]:
    """The dotted keys the user set (``--config FILE`` and ``key=value``), not defaults."""
    keys = set(config_lib.leaves(config_lib._read_file(path))) if path else set()
    for item in overrides:
        keys |= set(config_lib.leaves(config_lib.parse_override(item)))
    return keys


def config_layers(cfg: dict) -> int | None:
    """The layer count of the config's model, without building it (``model.from_pretrained``'s
    ``num_hidden_layers`` less DeepSeek's dense ``first_k_dense_replace``, else
    ``model.n_layers``)."""
    source = cfg["model"].get("from_pretrained")
    if source and cfg["model"]["name"] in models.HF_FAMILIES:
        hf = pretrained_config(source)
        n, dense = hf.get("num_hidden_layers"), hf.get("first_k_dense_replace") or 0
        return n - dense if isinstance(n, int) and isinstance(dense, int) else None
    return cfg["model"].get("n_layers")


def pretrained_config(source: str) -> dict:
    """``model.from_pretrained``'s config.json ({} when unreadable: building the model names
    what is wrong with it)."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def fit_layout(cfg: dict, explicit: set[str]) -> str | None:
    """A default pipeline layout the model is too shallow for (more chunks than layers), made
    to fit in ``cfg`` itself: fewer virtual stages, else no pipeline (its stages become data
    replicas), changing only keys the user did not set. Returns what it changed and why; a
    user's own choice that cannot work is left to :func:`check_layout` to refuse."""
    from fiddlejax.plan import interleaves

    p, mesh, layers = cfg["plan"], cfg["mesh"], config_layers(cfg)
    kind, pipe = p["schedule"], mesh["pipe"]
    if kind is None or layers is None or pipe < 2:
        return None
    virtual = p["virtual_stages"] or (2 if interleaves(kind) else 1)
    if layers >= pipe * virtual:
        return None
    mine = lambda *keys: not explicit & set(keys)  # noqa: E731 - none of them set by the user
    if virtual > 1 and layers >= pipe and mine("plan.virtual_stages") and (
            mine("plan.schedule") or kind != "zb-v"):
        picks = {"plan.virtual_stages": 1}
        if mine("plan.schedule") and kind in SINGLE_CHUNK:
            picks["plan.schedule"] = SINGLE_CHUNK[kind]
    elif mine("mesh.pipe", "plan.schedule", "plan.virtual_stages") and (
            mine("mesh.data") or mesh["data"] < 0):
        picks = {"mesh.pipe": 1, "plan.schedule": None, "plan.virtual_stages": None}
        if mesh["data"] > 0:
            picks["mesh.data"] = mesh["data"] * pipe
    else:
        return None
    fitted = {**cfg, "plan": dict(p), "mesh": dict(mesh)}
    for key, value in picks.items():
        section, name = key.split(".")
        fitted[section][name] = value
    try:
        if fitted["mesh"]["data"] > 0:
            config_lib.check_batch(fitted, fitted["mesh"]["data"])
    except config_lib.ConfigError:
        return None  # the batch does not split over the new layout: check_layout explains
    cfg["plan"], cfg["mesh"] = fitted["plan"], fitted["mesh"]
    what = (f"model.from_pretrained={cfg['model']['from_pretrained']}" if
            cfg["model"].get("from_pretrained") else "the model")
    return (f"# plan: {what} has {layers} layers, too few for the default {kind} with "
            f"mesh.pipe={pipe} x {virtual} virtual stages ({pipe * virtual} chunks, a layer "
            f"each); running {' '.join(f'{k}={v}' for k, v in picks.items())} instead "
            "(set these keys to choose)").replace("=None", "=null")


def check_seq_len(cfg: dict, model) -> None:
    """``model.seq_len`` beyond a pretrained model's ``max_position_embeddings``, refused in
    the job's keys before anything compiles."""
    most = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    seq = cfg["model"]["seq_len"]
    source = cfg["model"].get("from_pretrained")
    if source and most and seq > most:
        raise config_lib.ConfigError(
            f"model.seq_len={seq} is beyond the {most} positions of model.from_pretrained="
            f"{source} (max_position_embeddings in its config.json); set model.seq_len={most} "
            "or less")


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


def _schedule(cfg: dict, peak: float):
    """The learning-rate schedule of ``optimizer:``: warm-up, then cosine decay to 10%."""
    import optax

    o, steps = cfg["optimizer"], cfg["train"]["steps"]
    warm = min(o["warmup_steps"], max(steps - 1, 1))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(steps, warm + 1), peak * 0.1)


def learning_rates(cfg: dict):
    """step -> ``{"lr": ...}`` (and ``muon_lr``): what the optimizer applied at that step (its
    update count is step - 1), for metrics.jsonl and TensorBoard."""
    o = cfg["optimizer"]
    peaks = {"lr": o["lr"], **({"muon_lr": o["muon_lr"]} if o.get("name") == "muon" else {})}
    schedules = {k: _schedule(cfg, v) for k, v in peaks.items()}
    return lambda step: {k: float(f(step - 1)) for k, f in schedules.items()}


def make_optimizer(cfg: dict):
    """The ``optimizer:`` section: AdamW or Muon under a warm-up + cosine schedule, clipped."""
    import optax

    o = cfg["optimizer"]

    def schedule(peak: float):
        return _schedule(cfg, peak)

    name = o.get("name", "adamw")
    if name == "adamw":
        tx = optax.adamw(schedule(o["lr"]), b1=o["b1"], b2=o["b2"],
                         weight_decay=o["weight_decay"], nesterov=bool(o.get("nesterov")))
    elif name == "muon":
        from optax.contrib import muon

        tx = muon(schedule(o["muon_lr"]), weight_decay=o["weight_decay"],
                  adam_learning_rate=schedule(o["lr"]), adam_b1=o["b1"], adam_b2=o["b2"],
                  adam_weight_decay=o["weight_decay"],
                  muon_weight_dimension_numbers=entry(cfg).muon_dims)
    else:
        raise ValueError(f"optimizer.name={name!r} must be adamw or muon")
    if o.get("stale_correction"):
        import fiddlejax as fj

        tx = fj.stale_correction(tx, float(o["stale_correction"]))
    return optax.chain(clip_by_global_norm(o["clip"]), tx) if o["clip"] else tx


def clip_by_global_norm(max_norm: float):
    """``optax.clip_by_global_norm`` as one multiply by ``min(1, max_norm / norm)``: optax's
    ``select`` between the gradients and their scaled copy makes XLA hold that copy beside
    them (the whole float32 parameters again, measured before AdamW), a multiply fuses into
    the optimizer. Equal to optax's when the norm is below ``max_norm``, within an ulp above."""
    import jax
    import jax.numpy as jnp
    import optax

    def update(grads, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / optax.tree.norm(grads))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)
