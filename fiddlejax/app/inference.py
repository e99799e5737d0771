"""``fiddlejax eval`` and ``fiddlejax generate``: a trained run (``run.dir=DIR``, its latest
checkpoint or ``resume=N``) or a Hugging Face directory (``model.from_pretrained=DIR``).

- ``fiddlejax eval run.dir=DIR [data.path=...] [batches=N]`` prints the validation loss and
  perplexity (the run's own validation data unless ``data.*`` says otherwise);
- ``fiddlejax generate run.dir=DIR prompt="..." [max_new_tokens=N temperature=T top_p=P
  seed=S]`` prints the prompt's continuation, decoded with the run's tokenizer, using a KV cache
  (``fiddlejax.models.generate``).

Both run the unparallelized model on one device: the checkpoint is restored onto the run's
layout and gathered into the canonical parameters.
"""

from __future__ import annotations

import math
import sys

from fiddlejax import models
from fiddlejax.app import config as config_lib

OWN_KEYS = ("run.dir", "resume", "prompt", "max_new_tokens", "temperature", "top_p", "seed",
            "batches")


HELP = {
    "eval": """usage: fiddlejax eval run.dir=DIR [resume=N] [batches=N] [key=value ...]
       fiddlejax eval model.from_pretrained=DIR [data.path=...] [batches=N]

Validation loss and perplexity of a trained run's checkpoint (the latest, or resume=N) or of a
Hugging Face directory, on the run's own validation data unless data.* overrides say otherwise.

  run.dir=DIR                 a `fiddlejax train` run directory (its config.yaml and checkpoints)
  model.from_pretrained=DIR   a Hugging Face directory (config.json + safetensors)
  resume=N                    the checkpoint step (default: the latest)
  batches=N                   validation batches (default: the run's train.eval_batches, or 8)
  key=value                   config overrides, e.g. data.path=valid.jsonl data.batch_size=8
""",
    "generate": """usage: fiddlejax generate run.dir=DIR prompt="..." [max_new_tokens=N]
                          [temperature=T] [top_p=P] [seed=S] [resume=N]
       fiddlejax generate model.from_pretrained=DIR prompt="..." [...]

Continue a prompt with a trained run's model (or a Hugging Face directory's), decoded with its
tokenizer (data.tokenizer; a directory's own tokenizer.json or tokenizer.model), using a KV
cache on one device.

  prompt="..."                the text to continue
  max_new_tokens=N            at most N new tokens (default 64); stops at the tokenizer's EOS
  temperature=T               0 (default): greedy; > 0 samples
  top_p=P                     nucleus sampling (default 1.0: off)
  seed=S                      the sampling seed (default 0)
  resume=N                    run.dir's checkpoint step (default: the latest)
  key=value                   config overrides, e.g. data.tokenizer=path/to/tokenizer.json
""",
}


def parse(argv: list[str], command: str) -> tuple[dict, list[str]]:
    """``key=value`` arguments: this command's own keys, and config overrides (the rest)."""
    own, rest = {}, []
    for a in argv:
        if "=" not in a:
            raise config_lib.ConfigError(f"fiddlejax {command}: argument {a!r} must be "
                                         "key=value, e.g. run.dir=runs/default")
        k, v = a.split("=", 1)
        if k in OWN_KEYS:
            own[k] = v
        else:
            rest.append(a)
    return own, rest


def _number(own: dict, key: str, kind, default):
    try:
        return kind(own[key]) if key in own else default
    except ValueError:
        raise config_lib.ConfigError(f"{key}={own[key]!r} must be a {kind.__name__}") from None


def load(own: dict, overrides: list[str], command: str):
    """``(cfg, model, tokenizer, what)`` for a run directory or a Hugging Face directory."""
    from fiddlejax.app import build, compile_cache, runs
    from fiddlejax.data import tokenizer

    compile_cache.use(next((config_lib.parse_override(o)["run"]["compile_cache"]
                            for o in overrides if o.startswith("run.compile_cache=")), "auto"))

    if "run.dir" in own:
        run_dir = own["run.dir"]
        cfg = runs.run_config(run_dir)
        for item in overrides:  # e.g. data.path=... for eval: merged over the run's config
            cfg = config_lib._merge(cfg, config_lib.parse_override(item))
        step = _number(own, "resume", int, None)
        _, model, step = runs.restore(run_dir, step=step)  # cfg keeps the overrides
        what = f"{run_dir} step {step}"
    elif any(o.startswith("model.from_pretrained=") for o in overrides):
        cfg = config_lib.load(None, ["run.cpu_devices=0", *overrides])  # auto: DIR's family
        build.resolve_data(cfg)
        model = build.build_model(cfg["model"], 0)
        what = cfg["model"]["from_pretrained"]
    else:
        raise config_lib.ConfigError(f"fiddlejax {command} needs run.dir=DIR (a trained run) or "
                                     "model.from_pretrained=DIR (a Hugging Face directory)")
    tok = tokenizer.load(cfg["data"].get("tokenizer", "auto"),
                         cfg["model"].get("from_pretrained"))
    return cfg, model, tok, what


def evaluate(cfg: dict, model, batches: int) -> float:
    """Mean validation loss over ``batches`` validation batches (weighted losses exactly)."""
    import jax
    from flax import nnx

    from fiddlejax.staged import as_weighted

    data = models.get(cfg["model"]["name"]).batches(cfg, model, 0, 1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def loss(p, batch):
        return as_weighted(models.forward_loss(nnx.merge(graphdef, p, rest), batch))

    total = weight = 0.0
    for _ in range(batches):
        s, w = loss(params, next(data.validation))
        total, weight = total + float(s), weight + float(w)
    return total / weight


def eval_command(argv: list[str]) -> int:
    own, overrides = parse(argv, "eval")
    _number(own, "batches", int, 0)  # a typo is refused before the checkpoint is restored
    cfg, model, _, what = load(own, overrides, "eval")
    n = _number(own, "batches", int, cfg["train"].get("eval_batches") or 8)
    loss = evaluate(cfg, model, max(n, 1))
    print(f"{what}: validation loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f} "
          f"({max(n, 1)} batches of {cfg['data']['batch_size']})")
    return 0


def generate_command(argv: list[str]) -> int:
    own, overrides = parse(argv, "generate")
    n, sampling = sampling_args(own)  # before the model loads (a minute, at size)
    cfg, model, tok, what = load(own, overrides, "generate")
    if cfg["model"]["name"] not in models.DECODERS:
        raise config_lib.ConfigError(f"fiddlejax generate runs the decoders "
                                     f"({', '.join(models.DECODERS)}); {what} is "
                                     f"model.name={cfg['model']['name']}")
    prompt = own.get("prompt", "")
    new = continuation(model, tok, prompt, n, **sampling)
    print(prompt + tok.decode(new))
    return 0


def sampling_args(own: dict) -> tuple[int, dict]:
    """``max_new_tokens`` and the sampling keys of ``generate``, checked: a NaN or negative
    temperature, a ``top_p`` outside (0, 1] or no new token would decode nothing useful."""
    n = _number(own, "max_new_tokens", int, 64)
    t, p = _number(own, "temperature", float, 0.0), _number(own, "top_p", float, 1.0)
    if n < 1:
        raise config_lib.ConfigError(f"max_new_tokens={n} must be at least 1")
    if not (math.isfinite(t) and t >= 0):
        raise config_lib.ConfigError(f"temperature={own['temperature']} must be a number >= 0 "
                                     "(0: greedy decoding; e.g. temperature=0.7 samples)")
    if not 0 < p <= 1:  # NaN too
        raise config_lib.ConfigError(f"top_p={own['top_p']} must be in (0, 1] (1: off; e.g. "
                                     "top_p=0.9 samples from the top 90% of the probability)")
    return n, {"temperature": t, "top_p": p, "seed": _number(own, "seed", int, 0)}


def continuation(model, tok, prompt: str, max_new_tokens: int, **sampling) -> list[int]:
    """The ids ``fiddlejax generate`` decodes: the prompt (after the tokenizer's BOS) continued
    by ``max_new_tokens`` at most, cut before the first EOS (greedy unless ``temperature``)."""

    ids = list(tok.encode(prompt))
    if tok.bos_id is not None:
        ids = [tok.bos_id, *ids]
    if not ids:
        raise config_lib.ConfigError('fiddlejax generate needs prompt="some text"')
    out = models.generate_text(model, [ids], max_new_tokens, eos_id=tok.eos_id, **sampling)
    new = [int(i) for i in out[0, len(ids):]]
    return new[:new.index(tok.eos_id)] if tok.eos_id in new else new


def main(command: str, argv: list[str], debug: bool = False) -> int:
    """Run ``fiddlejax eval`` or ``generate``; a bad input is one line and exit status 2."""
    if any(a in ("-h", "--help") for a in argv):
        print(HELP[command], end="")
        return 0
    try:
        return (eval_command if command == "eval" else generate_command)(argv)
    except (ValueError, TypeError, LookupError, OSError) as e:
        if debug:
            raise
        print(f"fiddlejax {command}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    finally:
        sys.stdout.flush()
