"""fp8 matmuls (``Plan(matmul_dtype="fp8")``): per-tensor current scaling, the dense dots only.

The numerics are checked exactly against scaling by hand (e4m3 forward, e5m2 gradients, one
absmax per tensor); a training step against the same plan in bf16. Tolerances: the loss within
0.1% (the forward's rounding errors, up to 1/16 of each operand element in e4m3, average out over
the contraction and the batch); each gradient within 20% of bf16's in norm and pointing the same
way (cosine > 0.98). e5m2 keeps 2 mantissa bits, up to 12.5% error per element of the incoming
gradient, which a contraction only partly averages out (measured: at most 11%, cosines >= 0.994).
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import tokens

import fiddlejax as fj
from fiddlejax.app import build
from fiddlejax.app import config as config_lib
from fiddlejax.compute import fp8
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
DENSE = (((1,), (0,)), ((), ()))


def mesh(data, pipe=1, tensor=1):
    return fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])


def by_hand(a, dtype, top):
    """``a`` rounded to ``dtype`` after scaling by its absmax (``top``: the dtype's largest)."""
    scale = jnp.max(jnp.abs(a)) / top
    return (a / scale).astype(dtype).astype(jnp.float32) * scale


def test_dot_is_per_tensor_current_scaled_e4m3_with_e5m2_gradients():
    k = jax.random.split(jax.random.key(0), 3)
    x, w = 3 * jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (16, 4))
    g = jax.random.normal(k[2], (8, 4))
    out, vjp = jax.vjp(lambda x, w: fp8.dot(x, w, DENSE), x, w)
    xq, wq, gq = by_hand(x, fp8.E4M3, 448), by_hand(w, fp8.E4M3, 448), by_hand(g, fp8.E5M2, 57344)
    dx, dw = vjp(g)
    assert jnp.allclose(out, xq @ wq, atol=1e-5)
    assert jnp.allclose(dx, gq @ wq.T, atol=1e-5)
    assert jnp.allclose(dw, xq.T @ gq, atol=1e-5)
    assert float(jnp.max(jnp.abs(out - x @ w))) > 0.1  # really rounded, not a float32 dot
    # XLA's CPU emulates: it rounds to f8 (the converts stay in the compiled HLO) and upcasts
    compiled = jax.jit(jax.grad(lambda x, w: fp8.dot(x, w, DENSE).sum(), argnums=(0, 1))
                       ).lower(x, w).compile().as_text()
    assert "f8e4m3fn[" in compiled and "f8e5m2[" in compiled


def test_only_dots_against_the_weights_are_rewritten():
    """q and k projections: weight x activation, fp8; scores and mixing: activation x
    activation, left in bf16; a cast or reshape of a weight is still a weight."""
    def layer(p, x):
        q = x @ p["q"]
        k = x @ p["k"].astype(jnp.float32).reshape(4, 4)
        return jax.nn.softmax(q @ k.T) @ x

    params = {"q": jnp.ones((4, 4)), "k": jnp.ones((16,), jnp.bfloat16)}
    x = jnp.ones((3, 4))
    assert fp8.count(layer, params, x) == (2, 2)
    assert jnp.allclose(fp8.layer(layer, params, x), layer(params, x), rtol=1e-2)


def test_a_routers_logits_stay_bf16():
    """A dot whose result reaches a top_k through no other dot (a MoE router) is left alone:
    rounding its logits to fp8 could change which experts a token goes to."""
    def layer(p, x):
        gates, experts = jax.lax.top_k(jax.nn.softmax(jnp.tanh(x) @ p["router"]), 2)
        return (x @ p["w"]) * gates.sum(-1, keepdims=True) + experts.sum()

    params = {"router": jnp.ones((4, 8)), "w": jnp.ones((4, 4))}
    assert fp8.count(layer, params, jnp.ones((3, 4))) == (1, 1)


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, rngs=nnx.Rngs(0))


def loss_and_grads(model, batch, **plan):
    trainer = fj.parallelize(model, optax.adamw(1e-2), fj.Plan(compute_dtype="bfloat16", **plan))
    state = trainer.init()
    return trainer, state, *trainer.loss_and_grads(state, batch)


@pytest.mark.parametrize("layout", [
    dict(mesh=(1,)),
    # shard_map (pipeline), jax.checkpoint (remat), tensor parallel and FSDP together
    dict(mesh=(2, 2, 2), schedule="1f1b", microbatches=2, zero=3, remat="dots"),
], ids=["one-device", "pipe-1f1b-tensor-fsdp-remat"])
def test_fp8_step_close_to_bf16(model, layout):
    batch = tokens(0, 16, CFG.seq_len, CFG.vocab_size)
    layout = dict(layout, mesh=mesh(*layout["mesh"]))
    *_, loss, grads = loss_and_grads(model, batch, **layout)
    trainer, state, loss8, grads8 = loss_and_grads(model, batch, matmul_dtype="fp8", **layout)
    assert abs(float(loss8) - float(loss)) / float(loss) < 1e-3
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads8))  # float32 masters
    for g, g8 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads8), strict=True):
        norm = float(jnp.linalg.norm(g))
        assert float(jnp.linalg.norm(g8 - g)) < 0.2 * norm
        assert float(jnp.vdot(g, g8)) > 0.98 * norm * float(jnp.linalg.norm(g8))
    assert loss8 != loss  # the matmuls did change


def test_hlo_has_f8_dense_dots_and_a_bf16_head(model):
    """GPT's six dense matmuls per layer (q, k, v, out, MLP in and out) run on e4m3 operands;
    the backward's on e5m2 gradients; no f8 dot touches the vocabulary (256): the head stays
    bf16. (The lowered step: what a GPU's XLA maps to its fp8 GEMMs.)"""
    plan = fj.Plan(mesh=mesh(1), compute_dtype="bfloat16", matmul_dtype="fp8")
    trainer = fj.parallelize(model, optax.adamw(1e-2), plan)
    batch = {"tokens": jax.ShapeDtypeStruct((8, CFG.seq_len + 1), jnp.int32)}
    text = trainer.lower_step(trainer.abstract_state(), batch).as_text()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    f8 = [ln for ln in dots if "xf8" in ln]
    forward = [ln for ln in f8 if ln.count("xf8E4M3FN>") == 2]
    backward = [ln for ln in f8 if "xf8E5M2>" in ln]
    # each layer program's six, and a gradient for each operand of each in the backward
    assert len(forward) >= 6 and len(backward) == 2 * len(forward), (len(forward), len(backward))
    assert not any(re.search(r"\b256x|x256x", ln) for ln in f8)
    assert any(re.search(r"x256x", ln) for ln in dots)  # the head is there, in bf16


def test_bad_combinations_are_refused_before_compiling():
    with pytest.raises(ValueError, match="compute_dtype='bfloat16'"):
        fj.Plan(mesh=mesh(1), matmul_dtype="fp8")  # compute_dtype float32
    with pytest.raises(ValueError, match="matmul_dtype='int8' must be None"):
        fj.Plan(mesh=mesh(1), compute_dtype="bfloat16", matmul_dtype="int8")


def test_job_key(tmp_path):
    cfg = config_lib.load(None, ["plan.matmul_dtype=fp8", "mesh.data=-1", "mesh.pipe=1",
                                 "mesh.tensor=1", "plan.schedule=null"])
    plan = build.make_plan(cfg)  # compute_dtype=auto: bfloat16 with fp8, even on the CPU
    assert (plan.matmul_dtype, plan.compute_dtype) == ("fp8", "bfloat16")
    cfg["plan"]["compute_dtype"] = "float32"
    with pytest.raises(ValueError, match="set compute_dtype='bfloat16'"):
        build.make_plan(cfg)
    with pytest.raises(config_lib.ConfigError, match="plan.matmul_dtype='fp9'"):
        config_lib.load(None, ["plan.matmul_dtype=fp9"])


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.up, self.down = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Mine(nnx.Module):
    """A user's own NNX model: nnx.Linear blocks, unchanged for fp8."""

    def __init__(self, rngs, vocab=40, d=16):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(2)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.filterwarnings("ignore:Mine has no sharding names")
def test_a_users_own_model_gets_fp8_dense_matmuls():
    def ce(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])

    plan = fj.Plan(mesh=mesh(1), compute_dtype="bfloat16", matmul_dtype="fp8")
    trainer = fj.parallelize(Mine(nnx.Rngs(0)), optax.sgd(0.1), plan,
                             loss=fj.next_token(lambda lg, b: ce(lg, b).mean()), layers="blocks")
    batch = {"tokens": jax.random.randint(jax.random.key(0), (4, 9), 0, 40)}
    text = trainer.lower_step(trainer.init(), batch).as_text()
    forward = [ln for ln in text.splitlines()
               if "stablehlo.dot_general" in ln and ln.count("xf8E4M3FN>") == 2]
    assert {re.search(r"tensor<(\d+)x(\d+)xf8E4M3FN>\)", ln).groups() for ln in forward} == {
        ("16", "32"), ("32", "16")}  # up and down; not the head (16 x 40)
