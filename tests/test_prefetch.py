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


def test_a_layers_own_checkpoints_keep_their_policies_under_the_view():
    """Without a remat policy the view seals the layer (``memory.sealed``): a checkpoint inside
    it (MoE's blocked experts) keeps its own policy instead of the view's save-everything one,
    which saved every block's weight slices and activations."""
    from fiddlejax.compute import ParamView

    def layer(w, x):  # inner: save nothing, recompute the sines
        return jax.checkpoint(lambda v: jnp.sin(jnp.sin(v @ w["w"])),
                              policy=jax.checkpoint_policies.nothing_saveable)(x)

    w, x = {"w": jnp.ones((8, 8))}, jnp.ones((4, 8))
    for policy, most in ((None, 2), (jax.checkpoint_policies.everything_saveable, 4)):
        viewed = ParamView(dtype=None).layer(layer, {"w": -1}, policy)
        saved = jax.tree.leaves(jax.vjp(viewed, w, x)[1])  # the residuals the backward reads
        assert len([a for a in saved if a.shape == (4, 8)]) <= most, (policy, saved)
    # without the seal the view's policy saved the inner sines too (4 of shape (4, 8))


def test_zero3_adds_no_temporaries_to_an_expert_parallel_moe_step():
    """zero=3 over data x expert: its step holds at most one layer's gathered weights more than
    zero=0's (it was 5x zero=0's temporaries: benchmarks/results/zero3_temp.md)."""
    from fiddlejax.models.moe import MoEConfig
    from fiddlejax.models.moe_lm import MoELM

    cfg = MoEConfig(hidden_size=64, intermediate_size=128, num_experts=8,
                    num_experts_per_tok=2, router_aux_loss_coef=0.01)
    temps = {}
    for zero, prefetch in ((0, True), (3, False), (3, True)):  # the layer view, the stack
        model = nnx.eval_shape(lambda: MoELM(cfg, 128, 2, nnx.Rngs(0), report=False))
        trainer = fj.parallelize(model, optax.adamw(1e-3), fj.Plan(
            mesh=fj.make_mesh(data=2, expert=4), zero=zero, compute_dtype="float32",
            fsdp_prefetch=prefetch))
        state = trainer.abstract_state()
        step = trainer.lower_step(state, {"tokens": jax.ShapeDtypeStruct((8, 129), jnp.int32)})
        temps[zero, prefetch] = step.compile().memory_analysis().temp_size_in_bytes
    layer = 3 * 64 * 128 * 4 * 8 // 4  # a device's 2 experts of one layer, float32
    assert max(temps[3, False], temps[3, True]) <= temps[0, True] + layer, temps
