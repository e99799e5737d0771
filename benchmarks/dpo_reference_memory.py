"""DPO with LoRA: per-device memory of the reference scored in the step on the training layout
(``dpo.loss(in_step=True)``, :class:`fiddlejax.finetune.dpo.InStep`) against the reference
scored beforehand by a second copy of the starting model on one device.

Compile only (XLA's ``memory_analysis`` of one step, ``trainer.memory``), CPU, float32: a Llama
of hidden 512, MLP 1408, 4 layers, vocabulary 1024, rows of 64 + 1 tokens, batch 8, rank 16.
The beforehand path's device 0 holds the training step and the reference model's weights
(its whole parameters, kept for every batch); the in-step path holds the step alone.

    python benchmarks/dpo_reference_memory.py   # writes benchmarks/results/dpo_reference_memory.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.finetune import dpo, lora  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402

CONFIG = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     seq_len=64)
B, T = 8, 64
LAYOUTS = {"data=2 x tensor=2": dict(mesh=dict(data=2, tensor=2), schedule=None),
           "1F1B pipe=2 x data=2, 2 microbatches": dict(mesh=dict(data=2, pipe=2),
                                                        schedule="1f1b", microbatches=2)}


def batch(refs: bool) -> dict:
    spec = jax.ShapeDtypeStruct((B, T + 1), np.int32)
    out = {k: spec for k in ("tokens", "segment_ids", "positions", "loss_mask")}
    if refs:
        out |= {k: jax.ShapeDtypeStruct((B,), np.float32) for k in dpo.REF_KEYS}
    return out


def main() -> None:
    mib = 2 ** 20
    model = lora.add(nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0))),
                     lora.LoRA(rank=16, alpha=32.0))
    base_bytes = sum(x.size * x.dtype.itemsize for p, x in
                     jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
                     if not lora.is_adapter(p))
    rows = ["| layout | beforehand: step + reference copy (device 0) | in the step | ratio |",
            "|--------|---------------------------:|-----------:|------:|"]
    for name, kw in LAYOUTS.items():
        kw = dict(kw)
        plan = fj.Plan(mesh=fj.make_mesh(**kw.pop("mesh")), **kw)
        peaks = {}
        for in_step in (False, True):
            trainer = fj.parallelize(model, optax.adamw(1e-3), plan,
                                     loss=dpo.loss(0.1, CONFIG.vocab_size, in_step=in_step))
            peaks[in_step] = trainer.memory(batch=batch(not in_step))["peak_bytes"]
        before = peaks[False] + base_bytes
        rows.append(f"| {name} | {peaks[False] / mib:.1f} + {base_bytes / mib:.1f} = "
                    f"{before / mib:.1f} MiB | {peaks[True] / mib:.1f} MiB | "
                    f"{peaks[True] / before:.2f} |")
        print(rows[-1], flush=True)
    text = ("# DPO reference: scored in the step vs beforehand\n\n" + __doc__.split("\n\n")[1]
            + "\n\n" + "\n".join(rows) + "\n")
    out = Path(__file__).parent / "results" / "dpo_reference_memory.md"
    if "--print" in sys.argv:
        print(text)
    else:
        reporting.write(out, text)


if __name__ == "__main__":
    main()
