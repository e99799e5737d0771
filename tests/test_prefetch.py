"""FSDP's gathers one layer ahead (``fiddlejax.compute.prefetch``), read from the compiled step.

In each layer loop's body, the all-gathers (of the next layer) are issued before the matmuls and
consumed only by the next iteration, and the backward's reduce-scatters (of the previous
layer's gradient) take nothing from this iteration's matmuls: what a latency-hiding scheduler
needs to run them beside the compute. ``fsdp_prefetch=False`` is the control (each gather
feeds its own layer's matmuls). Exactness against one device: tests/test_scale_features.py
(zero=3 layouts, prefetched by default) and tests/test_context.py (FSDP with context).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from helpers import assert_loss_and_grads

import fiddlejax as fj
from fiddlejax.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fsdp_prefetch import loop_bodies  # noqa: E402

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=128)


def compiled(prefetch: bool):
    model = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    trainer = fj.parallelize(model, optax.sgd(1e-3), fj.Plan(
        mesh=fj.make_mesh(data=8), zero=3, remat="full", fsdp_prefetch=prefetch))
    state = trainer.abstract_state()
    step = trainer.lower_step(state, {"tokens": jax.ShapeDtypeStruct((16, 17), jnp.int32)})
    layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params["blocks"]))
    return step.compile(), layer // CFG.n_layers


def test_gathers_run_one_layer_ahead_in_the_compiled_loops():
    """Forward loop: every all-gather before the first dot, none feeding a dot; backward loop:
    no reduce-scatter fed by a dot of its iteration, each scheduled before its last dot, no
    all-gather feeding a dot. Off, the gathers feed the dots and the scatters follow them.
    Held: one more layer (float32 weights) at most, not the stack."""
    off, layer = compiled(False)
    on, _ = compiled(True)
    loops = {k: loop_bodies(c.as_text()) for k, c in (("off", off), ("on", on))}
    for k in loops:
        assert len(loops[k]) == 2, [lp["order"] for lp in loops[k]]  # forward, backward
    fwd_off, bwd_off = sorted(loops["off"], key=lambda lp: len(lp["scatter_after_dot"]))
    for feeds in (fwd_off["gather_feeds_dot"], bwd_off["scatter_after_dot"]):
        assert sum(feeds) >= len(feeds) - 2  # all but the biases' (added after a dot)
    fwd, bwd = sorted(loops["on"], key=lambda lp: len(lp["scatter_after_dot"]))
    kinds = [k for k, _ in fwd["order"]]
    assert "RS" not in kinds and kinds.count("AG") >= 6
    assert max(i for i, k in enumerate(kinds) if k == "AG") < kinds.index("DOT")
    assert not any(fwd["gather_feeds_dot"])
    kinds = [k for k, _ in bwd["order"]]
    assert kinds.count("RS") >= 6 and kinds.count("AG") >= 6
    last_dot = max(i for i, k in enumerate(kinds) if k == "DOT")
    assert all(i < last_dot for i, k in enumerate(kinds) if k == "RS")
    assert not any(bwd["scatter_after_dot"]) and not any(bwd["gather_feeds_dot"])
    grown = on.memory_analysis().temp_size_in_bytes - off.memory_analysis().temp_size_in_bytes
    assert 0 <= grown <= 1.1 * layer, (grown, layer)


def test_stack_matches_a_scan_and_saves_no_weight_or_constant_per_layer():
    """``prefetch.stack`` on one device (the "gather" a cast to bf16, the "scatter" one back):
    the plain scan's value and gradients, and neither the layer's gathered weights nor a
    constant it closes over (a mask) stacked per layer among the residuals; the layer inputs
    are ([3, 4, 8])."""
    from fiddlejax.compute import prefetch

    mask = np.tril(np.ones((1, 8), np.float32) + 1)
    bf16 = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)

    def layer(w, h):
        return jnp.tanh(h @ w["a"].astype(jnp.float32) * mask)

    run = prefetch.stack(layer, bf16, lambda g: jax.tree.map(
        lambda a: a.astype(jnp.float32), g), jax.checkpoint_policies.everything_saveable)
    ws = {"a": jax.random.normal(jax.random.key(0), (3, 8, 8))}
    h = jax.random.normal(jax.random.key(1), (4, 8))

    def plain(ws, h):
        return jax.lax.scan(lambda c, w: (layer(bf16(w), c), None), h, ws)[0]

    want = jax.value_and_grad(lambda ws, h: (plain(ws, h) ** 2).sum(), argnums=(0, 1))(ws, h)
    got = jax.value_and_grad(lambda ws, h: (run(ws, h) ** 2).sum(), argnums=(0, 1))(ws, h)
    assert_loss_and_grads(got, want, 1e-6)
    saved = jax.jit(jax.vjp, static_argnums=0).trace(run, ws, h).jaxpr.out_avals
    kinds = {(tuple(a.shape), str(a.dtype)) for a in saved}
    assert ((3, 4, 8), "float32") in kinds, kinds
    assert not {((3, 8, 8), "bfloat16"), ((3, 1, 8), "float32")} & kinds, kinds


def test_shards_over_context_alone_are_gathered_one_layer_ahead():
    """data=1 x context=4 x tensor=2 (sequence parallelism), zero=3 stores the shards over
    context: the stack's weight gathers (bf16, sent as uint16 bits) feed no dot of their own
    iteration in either loop, where without prefetch each feeds its layer's. The activations'
    gathers of sequence parallelism (float32 on the CPU) feed their dots either way.
    Exactness: tests/test_context.py::test_fsdp_over_data_and_context."""
    from fiddlejax.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, seq_len=32)
    weight_gathers = {}
    for prefetch in (False, True):
        model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
        trainer = fj.parallelize(model, optax.sgd(1e-3), fj.Plan(
            mesh=fj.make_mesh(data=1, context=4, tensor=2), zero=3, remat="full",
            sequence_parallel=True, compute_dtype="bfloat16", fsdp_prefetch=prefetch))
        text = trainer.lower_step(trainer.abstract_state(), {
            "tokens": jax.ShapeDtypeStruct((2, 33), jnp.int32)}).compile().as_text()
        loops = loop_bodies(text)
        assert len(loops) == 2, [lp["order"] for lp in loops]
        u16 = {line.split("=")[0].strip().lstrip("%") for line in text.splitlines()
               if " = u16[" in line and "all-gather(" in line}
        weight_gathers[prefetch] = [
            feeds for lp in loops
            for (kind, name), feeds in zip([o for o in lp["order"] if o[0] == "AG"],
                                           lp["gather_feeds_dot"], strict=True)
            if name in u16]
    assert len(weight_gathers[False]) >= 2 * 9 and all(weight_gathers[False])
    assert len(weight_gathers[True]) >= 2 * 9 and not any(weight_gathers[True])
