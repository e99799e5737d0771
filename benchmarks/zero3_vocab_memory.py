"""Per-device memory of a zero=3 step with the embedding and head split by vocabulary over
``data`` (``fiddlejax.compute.vocab``) against gathering them whole, compile-only (issue 45).

The model is abstract (``nnx.eval_shape``): nothing is allocated; each figure is XLA's
``memory_analysis`` of the compiled step on one of 8 simulated CPU devices: the arguments (the
float32 parameters and AdamW's two moments, a 1/8 shard each) and the temporaries. The control
gathers the embedding and head as every other parameter (the model's ``vocab_services`` off).
Ratios are of the bf16 checkpoint's bytes, as in ``hf_checkpoint_memory.py``; the host figure
multiplies a device's by 8 (one host holds every simulated device).

    python benchmarks/zero3_vocab_memory.py --layers 7 14

Writes benchmarks/results/zero3_vocab_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "zero3_vocab_memory.md"
DIMS = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
        "num_attention_heads": 16, "num_key_value_heads": 4}  # hf_checkpoint_memory.py's
BATCH, SEQ = 8, 64  # its job: data.batch_size=8, model.seq_len=64, one microbatch


def device_bytes(layers: int, split: bool) -> dict:
    """A device's argument and temporary bytes of the compiled zero=3 AdamW step."""
    cfg = LlamaConfig(**DIMS, num_hidden_layers=layers, max_position_embeddings=SEQ)
    cls = type("Gathered", (Llama,), {"vocab_services": False}) if not split else Llama
    model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    trainer = fj.parallelize(model, optax.adamw(1e-3), fj.Plan(
        mesh=fj.make_mesh(data=8), zero=3, compute_dtype="float32"))
    assert (trainer.layout.zero.vocab is not None) == split
    state = trainer.abstract_state()
    batch = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
    mem = trainer.lower_step(state, batch).compile().memory_analysis()
    return {"arguments": mem.argument_size_in_bytes, "temporaries": mem.temp_size_in_bytes}


def measure(layers: int) -> dict:
    d, f, v = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"]
    kv = DIMS["num_key_value_heads"] * d // DIMS["num_attention_heads"]
    checkpoint = 2 * (2 * v * d + d + layers * (2 * d + 2 * d * d + 2 * d * kv + 3 * d * f))
    row = {"layers": layers, "checkpoint_gb": checkpoint / 1e9}
    for name, split in (("gathered", False), ("split", True)):
        b = device_bytes(layers, split)
        row[name] = {**b, "host_ratio": 8 * (b["arguments"] + b["temporaries"]) / checkpoint}
    return row


def report(rows: list[dict]) -> str:
    lines = ["# zero=3: the embedding and head split by vocabulary, per device (compile-only)", "",
             "Llama of `hf_checkpoint_memory.py` (vocab 32000, hidden 1024), zero=3 on data=8, "
             "AdamW, float32, batch 8 x 64 tokens; XLA's `memory_analysis` of one device's "
             "compiled step (`python benchmarks/zero3_vocab_memory.py`). Host ratio: 8 devices' "
             "arguments + temporaries over the bf16 checkpoint's bytes.", "",
             "| layers | checkpoint | temporaries, gathered | temporaries, split | "
             "host ratio, gathered | host ratio, split |", "|---|---|---|---|---|---|"]
    for r in rows:
        g, s = r["gathered"], r["split"]
        lines.append(f"| {r['layers']} | {r['checkpoint_gb']:.3f} GB | "
                     f"{g['temporaries'] / 1e6:.0f} MB | {s['temporaries'] / 1e6:.0f} MB | "
                     f"{g['host_ratio']:.2f}x | {s['host_ratio']:.2f}x |")
    lines += ["", "```json", json.dumps(rows, indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[7, 14])
    rows = []
    for n in p.parse_args().layers:
        rows.append(measure(n))
        print(rows[-1], flush=True)
    reporting.write(OUT, report(rows))
    print(OUT.read_text())


if __name__ == "__main__":
    main()
