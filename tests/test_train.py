"""Data x tensor parallel training reproduces single-device float32 training."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    BF16,
    assert_close,
    assert_loss_and_grads,
    assert_trains_like_single_device,
    reference_loss_and_grads,
    reference_train,
    tokens,
)

import fiddlejax as fj
from fiddlejax.models.bert import BERT, BERTConfig, mlm_batch
from fiddlejax.models.cnn import CNN, CNNConfig
from fiddlejax.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
OPT = optax.adamw(1e-2)


def mesh(data, tensor, pipe=1):
    return fj.make_mesh(
        data=data, pipe=pipe, tensor=tensor, devices=jax.devices()[: data * tensor * pipe]
    )


@pytest.fixture(scope="module")
def gpt_reference():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    batches = [tokens(i, 8, CFG.seq_len, CFG.vocab_size) for i in range(3)]
    loss, grads = reference_loss_and_grads(model, batches[0])
    losses, params = reference_train(model, OPT, batches)
    return model, batches, float(loss), grads, losses, params


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("data,tensor", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 1)])
def test_gpt_matches_single_device(gpt_reference, data, tensor, zero):
    model, batches, ref_loss, ref_grads, ref_losses, ref_params = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(data, tensor), zero=zero))
    state = trainer.init()
    if not zero:  # ZeRO-1 changes only the optimizer state's layout, not loss_and_grads
        loss, grads = trainer.loss_and_grads(state, batches[0])
        assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, b)
        losses.append(float(metrics["loss"]))
    assert set(metrics) == {"loss", "grad_norm", "nonfinite_skipped"}  # a dense model's
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(trainer.params(state), ref_params)


def test_microbatch_accumulation_matches(gpt_reference):
    model, batches, ref_loss, ref_grads, *_ = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, 2), microbatches=2))
    loss, grads = trainer.loss_and_grads(trainer.init(), batches[0])
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_bf16_loss_and_every_leaf_within_bf16_of_float32(gpt_reference, remat):
    """bf16 compute without a pipeline: the loss and every leaf's gradient within bf16 error
    (helpers.BF16) of the float32 reference (a 16-bit carry stored as integer bits once cut the
    backward between layers: rel. err. 1). remat="full" keeps each layer's bf16 input as bits
    (remat.inputs_as_bits): the same to 1e-6 in every leaf."""
    model, batches, ref_loss, ref_grads, *_ = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, 1), compute_dtype="bfloat16",
                                                 remat=remat))
    loss, grads = trainer.loss_and_grads(trainer.init(), batches[0])
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads), BF16)
    if remat == "full":
        plain = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, 1), compute_dtype="bfloat16"))
        loss0, grads0 = plain.loss_and_grads(plain.init(), batches[0])
        assert float(loss) == float(loss0)
        # Every leaf bitwise equal but blocks/wq: 2 of its 2048 elements (layer 1) differ by
        # ~8.4e3 float32 ulps, 2.3e-6 of the leaf. That is one bf16 rounding (2**16 ulps) of a
        # summand ~8x the result (wq's gradient cancels under near-uniform attention: 4e-4 of
        # the total norm) flipped by a one-ulp float32 ordering difference upstream; both paths
        # are 1.0e-2 from float32 in that leaf alike.
        assert_close(grads, grads0, 1e-6, leaf_tol={"blocks/wq": 1e-5})


def test_unrolled_layers_match_and_leave_no_loop(gpt_reference):
    """Plan(unroll_layers=True): the same loss and gradients, and no while loop in the step."""
    model, batches, ref_loss, ref_grads, *_ = gpt_reference
    plan = fj.Plan(mesh=mesh(4, 2), microbatches=1, unroll_layers=True)
    trainer = fj.parallelize(model, OPT, plan)
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batches[0])
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    hlo = trainer.lower_step(state, batches[0]).as_text()
    assert " while(" not in hlo and "stablehlo.while" not in hlo
    with pytest.raises(TypeError, match="unroll_layers='yes'"):
        fj.Plan(mesh=mesh(4, 2), unroll_layers="yes")


def test_layers_unroll_off_the_cpu_unless_the_layout_gathers_them(monkeypatch):
    """unroll_layers=None: a GPU unrolls the layers unless the built layout gathers each
    layer's weights (FSDP over more than one data shard, which the scan prefetches); the
    layout decides, not the number the config gave (zero=3 on one data shard stores whole)."""
    from types import SimpleNamespace as NS

    from fiddlejax.parallel import data

    monkeypatch.setattr(data.jax, "default_backend", lambda: "gpu")
    auto = fj.Plan(mesh=mesh(8, 1), zero=3)
    assert not data.unrolled(NS(plan=auto, zero=NS(dims={"w": 0})))  # FSDP: a scan
    assert data.unrolled(NS(plan=auto, zero=NS(dims=None)))  # stored whole: unrolled
    assert not data.unrolled(NS(plan=fj.Plan(mesh=mesh(8, 1), unroll_layers=False),
                                zero=NS(dims=None)))


@pytest.mark.parametrize("vocab,tensor,tied", [(251, 4, False), (257, 2, True)])
def test_odd_vocab_and_tied_embeddings(vocab, tensor, tied):
    cfg = GPTConfig(
        vocab_size=vocab, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64, tie_embeddings=tied
    )
    model = GPT(cfg, rngs=nnx.Rngs(1))
    batch = tokens(3, 8, cfg.seq_len, vocab)
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, tensor)))
    state = trainer.init()
    assert state.params["wte"][...].shape[0] % tensor == 0  # padded internally
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    assert trainer.params(state)["wte"][...].shape == (vocab, 32)  # canonical shape


def test_bert_matches_single_device():
    cfg = BERTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    model = BERT(cfg, rngs=nnx.Rngs(0))
    batches = [mlm_batch(tokens(i, 8, 16, 256)["tokens"], cfg, seed=i) for i in range(3)]
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, 2)))
    assert_trains_like_single_device(trainer, model, OPT, batches)


def test_cnn_matches_single_device():
    model = CNN(CNNConfig(channels=8, n_layers=2), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = [{"images": rng.random((8, 8, 8, 1), np.float32),
                "labels": rng.integers(0, 10, 8).astype(np.int32)} for _ in range(3)]
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(2, 2)))
    assert_trains_like_single_device(trainer, model, OPT, batches)


def _collectives(hlo: str) -> dict[str, list[str]]:
    ops = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"):
        ops[op] = [ln for ln in hlo.splitlines() if re.search(rf" {op}(-start)?\(", ln)]
    return ops


def test_tensor_parallel_collectives_are_megatron(gpt_reference):
    """Row-parallel outputs are all-reduced over `tensor`; no full weight is gathered."""
    model, batches, *_ = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(1, 2)))
    ops = _collectives(trainer.compiled_step(trainer.init(), batches[0]).as_text())
    d, b, t = CFG.d_model, 8, CFG.seq_len
    act = f"f32[{b},{t},{d}]"
    # Forward: attention and MLP outputs (row-parallel), plus the vocab-parallel embedding.
    assert sum(act in ln for ln in ops["all-reduce"]) >= 3
    assert ops["all-gather"] == []  # no weight (or anything else) is all-gathered
    for ln in ops["all-reduce"]:  # nothing weight-shaped is reduced before the update
        assert f"f32[{d},{CFG.d_ff}]" not in ln.split("all-reduce")[0]


def test_zero1_shards_optimizer_state(gpt_reference):
    model, *_ = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(4, 2), zero=1))
    state = trainer.init()
    mu = state.opt_state[0].mu["blocks"]["w1"][...]
    assert mu.sharding.spec[:3] == (None, "data", "tensor")
    assert state.params["blocks"]["w1"][...].sharding.spec[:3] == (None, None, "tensor")
    # Each device holds 1/8 of mu but 1/2 of the parameter.
    assert mu.addressable_shards[0].data.size * 8 == mu.size


def test_errors_before_compile(gpt_reference):
    model, batches, *_ = gpt_reference
    with pytest.raises(ValueError, match="needs 16 devices but 8"):
        fj.make_mesh(data=4, pipe=2, tensor=2)
    with pytest.raises(ValueError, match="cannot infer data"):
        fj.make_mesh(data=-1, tensor=3)
    with pytest.raises(ValueError, match="n_heads=4 on dimension 2, not divisible by the tensor"):
        fj.parallelize(
            GPT(GPTConfig(n_heads=4, d_model=64, d_ff=64, n_layers=1), rngs=nnx.Rngs(0)),
            OPT,
            fj.Plan(mesh=mesh(1, 8)),
        )
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(4, 2), microbatches=2))
    state = trainer.init()
    with pytest.raises(ValueError, match="batch size 6 is not divisible by data=4 x micro"):
        trainer.step(state, {"tokens": batches[0]["tokens"][:6]})
    with pytest.raises(ValueError, match="pipe=2 but schedule=None"):
        fj.Plan(mesh=mesh(2, 2, pipe=2), schedule=None)
    with pytest.raises(ValueError, match="zero=5 must be 0"):
        fj.Plan(mesh=mesh(2, 2), zero=5)
    with pytest.raises(ValueError, match="zero=2 reduce-scatters .* grad_allreduce='xla'"):
        fj.Plan(mesh=mesh(2, 2), zero=2, grad_allreduce="ring")


def test_wrong_batch_dtype_and_shape():
    cfg = CNNConfig(channels=8, n_layers=1)
    trainer = fj.parallelize(CNN(cfg, rngs=nnx.Rngs(0)), OPT, fj.Plan(mesh=mesh(2, 1)))
    state = trainer.init()
    good = {"images": np.zeros((4, 8, 8, 1), np.float32), "labels": np.zeros(4, np.int32)}
    with pytest.raises(ValueError, match=r"batch\['labels'\] is float32\[4\], but CNN expects"):
        trainer.step(state, {**good, "labels": good["labels"].astype(np.float32)})
    with pytest.raises(ValueError, match="expects batch keys"):
        trainer.step(state, {"images": good["images"], "label": good["labels"]})


@pytest.mark.parametrize("algorithm", ["ring", "recursive-halving-doubling", "tree"])
def test_grad_allreduce_algorithms_train_like_xla(gpt_reference, algorithm):
    """Ten steps with each custom all-reduce give the same losses as XLA's psum (1e-6)."""
    model, *_ = gpt_reference
    batches = [tokens(100 + i, 8, CFG.seq_len, CFG.vocab_size) for i in range(10)]

    def run(alg):
        trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(4, 1), grad_allreduce=alg))
        state, losses = trainer.init(), []
        for b in batches:
            state, m = trainer.step(state, b)
            losses.append(float(m["loss"]))
        return np.array(losses)

    if "xla" not in _XLA_LOSSES:
        _XLA_LOSSES["xla"] = run("xla")
    np.testing.assert_allclose(run(algorithm), _XLA_LOSSES["xla"], rtol=1e-6)


_XLA_LOSSES: dict = {}


def test_remat_auto_picks_a_fitting_policy(gpt_reference):
    """A roomy budget keeps everything (no recompute); a tiny one fails with the smallest size."""
    model, batches, ref_loss, ref_grads, *_ = gpt_reference
    trainer = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(1, 1), remat="auto",
                                                 memory_budget=1 << 34))
    # lowering first (issue 21: it used to skip the policy choice and crash)
    old = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # every candidate kept in the suite's cache: the tight trainer's are the same programs
        assert trainer.lower_loss_and_grads(jax.eval_shape(trainer.init), batches[0]).compile()
        loss, grads = trainer.loss_and_grads(trainer.init(), batches[0])
        assert trainer.remat_policy.name == "none"
        assert_close(grads, ref_grads)
        tight = fj.parallelize(model, OPT, fj.Plan(mesh=mesh(1, 1), remat="auto",
                                                   memory_budget=1024))
        with pytest.raises(ValueError, match="no remat policy fits memory_budget=1024"):
            tight.lower_loss_and_grads(jax.eval_shape(tight.init), batches[0])
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old)
    with pytest.raises(ValueError, match="needs Plan\\(memory_budget"):
        fj.parallelize(model, OPT, fj.Plan(mesh=mesh(1, 1), remat="auto"))


def test_the_jobs_gradient_clip_is_optaxs_without_a_copy_of_the_gradients():
    """The job's ``optimizer.clip`` (app.build.clip_by_global_norm) equals optax's below and
    within float32 rounding above the norm, and AdamW after it holds no copy of the gradients
    (optax's select holds one: the whole float32 parameters), compiled, nothing allocated."""
    from fiddlejax.app.build import clip_by_global_norm

    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.full(4, -0.5)}
    for max_norm in (100.0, 1.0):  # below the norm (8.5) is the identity; above, a scale
        ours, _ = clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        for k in grads:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=2e-7, atol=0)
    assert float(optax.tree.norm(ours)) == pytest.approx(1.0, rel=1e-6)

    params = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 4
    temps = {}
    for name, clip in (("ours", clip_by_global_norm(1.0)),
                       ("optax", optax.clip_by_global_norm(1.0))):
        opt = optax.chain(clip, optax.adamw(1e-3))

        def step(p, s, g, opt=opt):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            params, jax.eval_shape(opt.init, params), params).compile()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    whole = 4 * 256 * 256 * 4
    assert temps["ours"] < 0.1 * whole <= whole <= temps["optax"], temps
