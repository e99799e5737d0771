"""What zero=3 adds to a step's temporary memory, per layout, compile-only (issue 52 item 5d).

zero=3 stores a device's shard of each parameter and gathers a layer's weights just before
use; its backward gathers them again instead of saving them. So its step should hold at most
one layer's gathered weights (two with prefetch) more than the same layout without zero=3,
and usually less: zero=0 holds every gradient whole. Each row compiles one AdamW step (float32,
no remat) of a model built abstractly (``nnx.eval_shape``: nothing allocated) on 8 simulated
CPU devices, at zero=0 and at zero=3 with prefetch off and on, and reads XLA's
``memory_analysis`` of one device: temporaries, and zero=3's excess over zero=0 in units of
one layer's gathered float32 weights on that device (its shard over the other axes).

    python benchmarks/zero3_temp.py

Writes benchmarks/results/zero3_temp.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import reporting  # noqa: E402
from flax import nnx  # noqa: E402

import fiddlejax as fj  # noqa: E402
from fiddlejax.models.llama import Llama, LlamaConfig  # noqa: E402
from fiddlejax.models.moe import MoEConfig  # noqa: E402
from fiddlejax.models.moe_lm import MoELM  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "zero3_temp.md"
LAYERS, ROWS, SEQ, VOCAB = 4, 16, 256, 1024
MOE = MoEConfig(hidden_size=256, intermediate_size=512, num_experts=8, num_experts_per_tok=2,
                router_aux_loss_coef=0.01)
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                    num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=LAYERS,
                    max_position_embeddings=SEQ)
MODELS = {"MoE (8 experts, top-2, dropless)": lambda: MoELM(MOE, VOCAB, LAYERS, nnx.Rngs(0),
                                                            report=False),
          "Llama": lambda: Llama(LLAMA, rngs=nnx.Rngs(0))}
LAYOUTS = [("MoE (8 experts, top-2, dropless)", {"data": 8}),
           ("MoE (8 experts, top-2, dropless)", {"data": 2, "expert": 4}),
           ("MoE (8 experts, top-2, dropless)", {"data": 4, "expert": 2}),
           ("MoE (8 experts, top-2, dropless)", {"data": 2, "expert": 2, "tensor": 2}),
           ("Llama", {"data": 8}),
           ("Llama", {"data": 4, "tensor": 2})]


def compiled(name: str, sizes: dict, **plan) -> tuple[int, int]:
    """One device's (temporary bytes, one layer's gathered float32 weight bytes)."""
    model = nnx.eval_shape(MODELS[name])
    trainer = fj.parallelize(model, optax.adamw(1e-3), fj.Plan(
        mesh=fj.make_mesh(**sizes), compute_dtype="float32", **plan))
    state = trainer.abstract_state()
    batch = {"tokens": jax.ShapeDtypeStruct((ROWS, SEQ + 1), jnp.int32)}
    temp = trainer.lower_step(state, batch).compile().memory_analysis().temp_size_in_bytes
    layer = 0  # zero=0: a stacked leaf's device shard over the layers is one gathered layer
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        shape = leaf.sharding.shard_shape(leaf.shape)
        if jax.tree_util.keystr(path).startswith("['blocks']"):
            layer += int(np.prod(shape[1:])) * leaf.dtype.itemsize
    return temp, layer


def measure(name: str, sizes: dict) -> dict:
    base, layer = compiled(name, sizes, zero=0)
    row = {"model": name, "mesh": sizes, "layer_bytes": layer, "zero0": base}
    for prefetch in (False, True):
        temp = compiled(name, sizes, zero=3, fsdp_prefetch=prefetch)[0]
        row[f"zero3_prefetch_{'on' if prefetch else 'off'}"] = temp
    return row


def report(rows: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = ["# zero=3's temporaries against the same layout without it (compile-only)", "",
             f"One AdamW step, float32, no remat, {LAYERS} layers, batch {ROWS} x {SEQ} "
             f"tokens, vocabulary {VOCAB}, on 8 simulated CPU devices; XLA's `memory_analysis` "
             "of one device (`python benchmarks/zero3_temp.py`). MoE: hidden 256, MLP 512, "
             "8 experts, top-2, dropless (the blocked grouped matmul on the CPU). Llama: hidden "
             "256, MLP 704, 8 heads, 4 KV heads. *Excess*: zero=3's temporaries minus "
             "zero=0's, in layers' gathered float32 weights on one device (target: at most 1; "
             "prefetch holds one more layer by design).", "",
             "| model | mesh | one layer (MiB) | zero=0 temp (MiB) | zero=3 temp, prefetch off "
             "| zero=3 temp, prefetch on | excess off (layers) | excess on (layers) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        off, on = r["zero3_prefetch_off"], r["zero3_prefetch_on"]
        ex = lambda t, r=r: f"{(t - r['zero0']) / r['layer_bytes']:+.2f}"  # noqa: E731
        lines.append(f"| {r['model']} | {mesh} | {mib(r['layer_bytes'])} | {mib(r['zero0'])} "
                     f"| {mib(off)} | {mib(on)} | {ex(off)} | {ex(on)} |")
    lines += ["", "```json", json.dumps(rows, indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    rows = []
    for name, sizes in LAYOUTS:
        rows.append(measure(name, sizes))
        print(rows[-1], flush=True)
    reporting.write(OUT, report(rows))
    print(OUT.read_text())


if __name__ == "__main__":
    main()
