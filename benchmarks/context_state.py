"""What the default context layout holds of the weights and AdamW state, per device (issue 52
item 5a): compile only, an abstract Llama on 8 simulated CPU devices (data=2 x context=4).

Context replicas hold the same parameters. With ``plan.zero=0`` each device kept whole
weights and AdamW's two moments (MaxText shards them over data x context); the job's default
``plan.zero=auto`` is FSDP over data x context when ``context`` > 1 without a pipeline. The
figure is the compiled step's argument bytes (the state and one batch) per device.

    python benchmarks/context_state.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.app import build  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, seq_len=2048,
                  max_position_embeddings=2048)
SEQ, BATCH = 2048, 2


def argument_mib(zero: int) -> float:
    model = nnx.eval_shape(lambda: Llama(CFG, rngs=nnx.Rngs(0)))
    mesh = fj.make_mesh(data=2, context=4)
    t = fj.parallelize(model, optax.adamw(1e-3), fj.Plan(mesh=mesh, zero=zero))
    state = t.abstract_state()
    batch = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), "int32")}
    mem = t.lower_step(state, batch).compile().memory_analysis()
    return mem.argument_size_in_bytes / 2**20


def main() -> None:
    import reporting

    default = build.zero_level("auto", fj.make_mesh(data=2, context=4), None)
    before, after = argument_mib(0), argument_mib(default)
    lines = ["# The default context layout: weights and AdamW state per device", "",
             f"Llama ({CFG.num_hidden_layers} layers, hidden {CFG.hidden_size}, vocab "
             f"{CFG.vocab_size}), seq_len {SEQ}, batch {BATCH}, data=2 x context=4, AdamW; "
             "compiled step's argument bytes per device (state and batch), compile only.", "",
             "| plan.zero | argument MiB per device | vs zero=0 |", "|---|---|---|",
             f"| 0 (the default before) | {before:.2f} | 1.00x |",
             f"| auto = {default} (the default) | {after:.2f} | {after / before:.2f}x |", ""]
    reporting.write(ROOT / "benchmarks" / "results" / "context_state.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
