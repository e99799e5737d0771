"""The SPMD pipeline runtime reproduces single-device float32 training for every schedule."""

import jax
import optax
import pytest
from flax import nnx
from helpers import (
    assert_close,
    assert_loss_and_grads,
    assert_trains_like_single_device,
    reference_loss_and_grads,
    rel_err,
    tokens,
)

import fiddlejax as fj
from fiddlejax.models.bert import BERT, BERTConfig, mlm_batch
from fiddlejax.models.gpt import GPT, GPTConfig
from fiddlejax.pipeline import runtime, schedules


def gpt(n_layers=8, tied=False, seed=0):
    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=n_layers,
                    d_ff=64, tie_embeddings=tied)
    return GPT(cfg, rngs=nnx.Rngs(seed))


def plan(data, pipe, tensor, **kw):
    mesh = fj.make_mesh(data=data, pipe=pipe, tensor=tensor,
                        devices=jax.devices()[: data * pipe * tensor])
    return fj.Plan(mesh=mesh, **kw)


def check(model, p, batch, tol=1e-5):
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, optax.adamw(1e-3), p)
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads), tol)
    return trainer


CASES = [
    # kind, (data, pipe, tensor), microbatches, virtual stages, layers
    ("gpipe", (1, 2, 1), 2, 1, 8),
    ("1f1b", (1, 4, 1), 4, 1, 8),
    ("1f1b", (1, 4, 1), 6, 1, 8),        # m not a multiple of p
    ("1f1b", (2, 2, 2), 4, 1, 8),        # with data and tensor axes
    ("interleaved-1f1b", (1, 2, 1), 2, 2, 8),
    ("interleaved-1f1b", (1, 4, 1), 8, 2, 8),
    ("interleaved-1f1b", (1, 2, 1), 3, 2, 8),  # m not a multiple of p
    ("interleaved-1f1b", (2, 2, 2), 4, 2, 8),
    ("zb-h1", (1, 4, 1), 4, 1, 8),
    ("zb-h1", (2, 2, 2), 4, 1, 8),
    ("1f1b", (1, 4, 1), 4, 1, 6),        # 6 layers on 4 stages
    ("zb-v", (1, 4, 1), 4, 2, 8),        # V placement: local hand-off on stage 3
    ("zb-v", (2, 2, 2), 4, 2, 8),
    ("interleaved-zb", (1, 2, 1), 4, 2, 8),
]


@pytest.mark.parametrize("kind,mesh,m,v,layers", CASES)
def test_gpt_loss_and_grads(kind, mesh, m, v, layers):
    data = mesh[0]
    batch = tokens(m, 2 * m * data, 16, 256)
    check(gpt(layers), plan(*mesh, schedule=kind, microbatches=m, virtual_stages=v), batch)


def test_tied_embeddings_interleaved():
    batch = tokens(1, 8, 16, 256)
    check(gpt(8, tied=True), plan(2, 2, 2, schedule="interleaved-1f1b", microbatches=4,
                                  virtual_stages=2), batch)


VOCAB_CASES = [
    # kind, (data, pipe, tensor), microbatches, virtual stages, tied
    ("gpipe", (1, 2, 2), 2, 1, True),
    ("gpipe", (1, 2, 2), 2, 1, False),
    ("1f1b", (2, 2, 2), 4, 1, True),
    ("1f1b", (2, 2, 2), 4, 1, False),
    ("interleaved-1f1b", (1, 2, 2), 4, 2, True),
    ("zb-h1", (1, 4, 2), 4, 1, True),
    ("zb-v", (1, 2, 2), 4, 2, True),
    ("zb-v", (1, 2, 2), 4, 2, False),
    ("interleaved-zb", (1, 2, 2), 4, 2, True),
]


@pytest.mark.parametrize("kind,mesh,m,v,tied", VOCAB_CASES)
def test_vocabulary_parallel_embedding_and_head(kind, mesh, m, v, tied):
    """A vocabulary large enough to be split over pipe x tensor (4099 x 32 > 65,536 elements,
    padded to a multiple of pipe x tensor): no stage holds a replica, and the loss and
    gradients still equal one device's, tied or not."""
    cfg = GPTConfig(vocab_size=4099, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=64,
                    tie_embeddings=tied)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    batch = tokens(m, 2 * m * mesh[0], 16, 4099)
    trainer = check(model, plan(*mesh, schedule=kind, microbatches=m, virtual_stages=v), batch)
    wte = trainer.param_shardings["wte"]
    spec = (wte.get_value() if hasattr(wte, "get_value") else wte).spec
    assert spec[0] == ("pipe", "tensor"), spec  # the vocabulary over pipe x tensor


def test_bert_pipeline():
    cfg = BERTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=64)
    model = BERT(cfg, rngs=nnx.Rngs(0))
    batch = mlm_batch(tokens(2, 8, 16, 256)["tokens"], cfg, seed=0)
    check(model, plan(2, 2, 2, schedule="1f1b", microbatches=2), batch)


def test_ten_steps_equal_single_device():
    model = gpt(4)
    opt = optax.adamw(1e-2)
    batches = [tokens(10 + i, 8, 16, 256) for i in range(10)]
    trainer = fj.parallelize(model, opt, plan(2, 2, 2, schedule="interleaved-1f1b",
                                              microbatches=2, virtual_stages=2))
    assert_trains_like_single_device(trainer, model, opt, batches, check_grads=False)


def test_params_round_trip_through_pipeline_layout():
    model = gpt(6)
    trainer = fj.parallelize(model, optax.sgd(0.0), plan(1, 4, 1, schedule="interleaved-1f1b",
                                                         microbatches=4, virtual_stages=1))
    canonical = nnx.state(model, nnx.Param)
    assert rel_err(trainer.params(trainer.init()), canonical) == 0.0


def test_tables_stash_sized_by_peak():
    s = schedules.build("1f1b", stages=4, microbatches=16)
    tb = runtime.build_tables(s, [2, 2, 2, 2])
    assert tb.num_stash == 4  # the schedule's peak, not the microbatch count
    assert tb.num_inbox == 3  # an activation, a cotangent, and the trash slot
    g = runtime.build_tables(schedules.build("gpipe", stages=4, microbatches=16), [2] * 4)
    assert g.num_stash == 16


def test_memory_flat_in_microbatches_for_1f1b():
    def temp(kind, m):
        trainer = fj.parallelize(gpt(4), optax.sgd(1e-3), plan(1, 2, 1, schedule=kind,
                                                               microbatches=m))
        batch = trainer.shard_batch(tokens(0, 2 * m, 16, 256))
        state = jax.eval_shape(trainer.init)
        return trainer.compiled_step(state, batch).memory_analysis().temp_size_in_bytes

    assert temp("1f1b", 4) == temp("1f1b", 2)  # the stash holds at most p microbatches
    assert temp("gpipe", 4) > 1.25 * temp("gpipe", 2)  # GPipe holds all m


def test_errors_before_compile():
    with pytest.raises(ValueError, match="n_layers=3 is fewer than stages x virtual_stages = 4"):
        fj.parallelize(gpt(3), optax.sgd(1e-3), plan(1, 2, 1, schedule="interleaved-1f1b",
                                                     microbatches=2, virtual_stages=2))
    trainer = fj.parallelize(gpt(4), optax.sgd(1e-3), plan(2, 2, 1, schedule="1f1b",
                                                          microbatches=4))
    with pytest.raises(ValueError, match="not divisible by data=2 x microbatches=4 = 8"):
        trainer.step(trainer.init(), tokens(0, 12, 16, 256))
    with pytest.raises(ValueError, match="virtual_stages=2 needs an interleaved schedule"):
        plan(1, 2, 1, schedule="1f1b", virtual_stages=2)


def test_a_large_vocabulary_leaves_the_stages_balanced():
    """The embedding and head run over every device (vocabulary parallel), not on the end
    stages, so balancing by parameters or FLOPs splits the layers as evenly as uniform does."""
    cfg = GPTConfig(vocab_size=8192, seq_len=16, d_model=32, n_heads=4, n_layers=10, d_ff=64)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    counts = {}
    for method in ("uniform", "params", "cost"):
        trainer = fj.parallelize(model, optax.sgd(0.1), plan(2, 4, 1, schedule="1f1b",
                                                            microbatches=4, partition=method))
        counts[method] = trainer.pipeline.counts
    assert counts["uniform"] == [2, 3, 3, 2]
    assert counts["params"] == counts["cost"] == [2, 3, 3, 2]


@pytest.mark.parametrize("kind,m,v,remat", [("1f1b", 2, 1, "none"), ("interleaved-1f1b", 2, 2,
                                            "full"), ("zb-h1", 2, 1, "none")])
def test_compiled_flops_equal_unpipelined(kind, m, v, remat):
    """No stage repeats or masks work: matmul FLOPs over all stages = the unpipelined step's."""
    from fiddlejax.memory import policies
    from fiddlejax.pipeline import costs

    model = gpt(4)
    batch = tokens(3, 2 * m, 16, 256)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan(1, 2, 1, schedule=kind,
                                                        microbatches=m, virtual_stages=v,
                                                        remat=remat))
    per_stage = trainer.stage_flops(trainer.init(), batch)
    ref = costs.unpipelined_flops(trainer.staged, nnx.state(model, nnx.Param), batch,
                                  lambda f: policies.remat_layer(f, remat))
    ratio = sum(s["dot_flops"] for s in per_stage) / ref["dot_flops"]
    assert abs(ratio - 1) < 0.02, ratio
    # Equal layers per stage and the head spread over all stages: equal matmul work.
    dots = [s["dot_flops"] for s in per_stage]
    assert max(dots) / min(dots) < 1.001, dots


def _muon_corrected():
    from optax.contrib import muon

    from fiddlejax import models

    return fj.stale_correction(muon(1e-2, adam_learning_rate=1e-2, muon_weight_dimension_numbers=
                                    models.REGISTRY["gpt"].muon_dims), 1.0)


@pytest.mark.parametrize("make_opt,layout", [
    (lambda: optax.adamw(1e-2), (2, 2, 2)),
    (_muon_corrected, (1, 2, 2)),  # Muon's per-matrix update on tensor-sharded matrices
], ids=["adamw", "muon-stale-correction"])
def test_2bw_equals_the_one_step_stale_update_rule(make_opt, layout):
    """PipeDream-2BW: W(t+1) = W(t) + update(grad f(W(t-1))), with W(-1) = W(0).

    Two steps in one unflushed program, then more calls (that program again; AdamW: ``step``,
    the one-step program): the older weight version carries over from call to call.
    """
    import numpy as np
    from helpers import reference_loss_fn, stale_reference

    opt = make_opt()
    batches = [tokens(20 + i, 8, 16, 256) for i in range(4)]
    loss, params = reference_loss_fn(gpt(4))
    ref_losses, prev, cur = stale_reference(loss, opt, params, batches)

    trainer = fj.parallelize(gpt(4), opt, plan(*layout, schedule="2bw", microbatches=2,
                                               remat="full"))
    state, losses = trainer.init(), []
    state, m = trainer.steps(state, {"tokens": np.stack([b["tokens"] for b in batches[:2]])})
    losses += np.asarray(m["loss"]).tolist()
    if layout == (2, 2, 2):
        for b in batches[2:]:
            state, m = trainer.step(state, b)
            losses.append(float(m["loss"]))
    else:
        state, m = trainer.steps(state, {"tokens": np.stack([b["tokens"] for b in batches[2:]])})
        losses += np.asarray(m["loss"]).tolist()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert int(state.step) == 4
    assert_close(trainer.params(state), cur)
    assert_close(trainer.to_canonical_state(state).prev_params, prev, what="prev_params")
    if layout != (2, 2, 2):
        return
    with pytest.raises(ValueError, match="set zero=0"):
        plan(1, 2, 1, schedule="2bw", microbatches=2, zero=1)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), opt)
    with pytest.raises(ValueError, match="optimizer.clip=0"):
        fj.parallelize(gpt(4), clipped, plan(1, 2, 1, schedule="2bw", microbatches=2))


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_split_backward_equals_single_device(kind, v):
    """Whole backwards run as I then W on consecutive ticks: same gradients, unit-cost ticks."""
    p = plan(1, 2, 1, schedule=kind, microbatches=4, virtual_stages=v, split_backward=True)
    trainer = check(gpt(4), p, tokens(5, 8, 16, 256))
    run = trainer.pipeline.schedule_run
    assert run.split_backward and not trainer.pipeline.schedule.split_backward
    assert abs(run.ticks.weighted_bubble_fraction - run.bubble_fraction) < 0.01
    assert run.ticks.weighted_bubble_fraction < trainer.pipeline.schedule.ticks.\
        weighted_bubble_fraction


def test_auto_split_keeps_whole_backwards_on_cpu():
    trainer = fj.parallelize(gpt(4), optax.sgd(0.1), plan(1, 2, 1, schedule="1f1b",
                                                         microbatches=4))
    assert trainer.pipeline.schedule_run is trainer.pipeline.schedule
    with pytest.raises(TypeError, match="split_backward='yes' must be True, False or None"):
        plan(1, 2, 1, schedule="1f1b", split_backward="yes")


def test_tick_traffic_does_not_grow_with_microbatches():
    """Buffers are updated in place: one tick's bytes (unroll 2 minus unroll 1) is flat in m."""
    def tick_bytes(m):
        out = []
        for unroll in (1, 2):  # a fresh trainer each: jit caches the traced step
            trainer = fj.parallelize(gpt(4), optax.sgd(0.1), plan(1, 2, 1, schedule="gpipe",
                                                                 microbatches=m))
            trainer.pipeline.tick_unroll = unroll
            state = jax.eval_shape(trainer.init)
            c = trainer.lower_step(state, tokens(0, 2 * m, 16, 256)).compile()
            out.append(c.cost_analysis()["bytes accessed"])
        return out[1] - out[0]

    assert tick_bytes(8) == tick_bytes(2)  # GPipe's stash is 4x larger at m=8




def test_zb_v_as_written_equals_single_device():
    """split_backward=False runs zb-v split, as a GPU does (on the CPU the default joins each I
    with its W: test_gpt_loss_and_grads covers that path)."""
    p = plan(1, 2, 1, schedule="zb-v", microbatches=4, virtual_stages=2, split_backward=False)
    trainer = check(gpt(4), p, tokens(3, 8, 16, 256))
    pl = trainer.pipeline
    assert pl.schedule_run is pl.schedule and pl.tables.split
    assert pl.tables.num_stash == max(pl.schedule.held_peak)
    joined = runtime.executed(pl.schedule)  # the CPU's default: one B per I and its W
    assert not joined.split_backward and joined.ticks.num_ticks < pl.schedule.ticks.num_ticks
    assert runtime.executed(pl.schedule, True) is pl.schedule
