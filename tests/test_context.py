"""Context parallelism (issue 35): sequences split over the ``context`` axis, attention joined by
ring attention or all-gathered K/V; loss and gradients equal one device's (float32)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, assert_loss_and_grads, reference_loss_and_grads, rel_err, tokens

import fiddlejax as fj
from fiddlejax.models.common import positions_of, stacked
from fiddlejax.models.llama import Llama, LlamaConfig
from fiddlejax.parallel import context, flash

SEQ = 16


@pytest.fixture(scope="module")
def llama():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, seq_len=SEQ)
    return Llama(cfg, rngs=nnx.Rngs(0))


def packed(seed: int, batch: int) -> dict:
    """Tokens with 2-4 documents per row (and padding, segment 0, at some rows' ends)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, SEQ + 1), np.int32)
    for r in range(batch):
        cuts = np.sort(rng.choice(np.arange(2, SEQ), size=rng.integers(1, 4), replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(SEQ + 1), side="right") + 1
        if r % 2:
            seg[r, -3:] = 0
    out = tokens(seed, batch, SEQ, 64)
    out["segment_ids"] = seg
    out["positions"] = np.asarray(positions_of(seg))
    return out


def assert_exact(model, plan, batch):
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    trainer = fj.parallelize(model, optax.sgd(0.1), plan)
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("kernel", ["ring", "allgather"])
def test_context4_data2_matches_one_device(llama, kernel, monkeypatch):
    """The ring on packed documents (segment ids travel with K/V), its blocks cut into
    one-token tiles; the all-gather on plain rows."""
    monkeypatch.setattr(flash, "TILE", 1 if kernel == "ring" else flash.TILE)
    batch = packed(1, 4) if kernel == "ring" else tokens(1, 4, SEQ, 64)
    assert_exact(llama, fj.Plan(mesh=fj.make_mesh(data=2, context=4), context_kernel=kernel),
                 batch)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_context2_pipe2_tensor2_matches_one_device(llama, schedule):
    mesh = fj.make_mesh(data=1, pipe=2, context=2, tensor=2)
    assert_exact(llama, fj.Plan(mesh=mesh, schedule=schedule, microbatches=2),
                 tokens(2, 4, SEQ, 64))


def test_packed_documents_context2_data4(llama):
    """Segment ids and positions cross the shard boundaries with their tokens."""
    batch = packed(3, 4)
    assert_exact(llama, fj.Plan(mesh=fj.make_mesh(data=4, context=2)), batch)


@pytest.mark.parametrize("axes", [dict(data=2, context=4), dict(data=1, context=4, tensor=2)])
def test_fsdp_over_data_and_context(llama, axes):
    """zero=3 shards the parameters over data x context (context replicas hold the same
    parameters): each device stores 1/8 of a layer's weights. data=1 is the layout the
    planner picks for Llama-3-8B at 128k (with tensor=2 and sequence parallelism)."""
    plan = fj.Plan(mesh=fj.make_mesh(**axes), zero=3, sequence_parallel="tensor" in axes)
    batch = tokens(4, 4, SEQ, 64)
    ref_loss, ref_grads = reference_loss_and_grads(llama, batch)
    trainer = fj.parallelize(llama, optax.sgd(0.1), plan)
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
    w = state.params["blocks"]["w2"]
    assert w.addressable_shards[0].data.size * 8 == w.size
    assert "context" in jax.tree.leaves(tuple(w.sharding.spec))


@pytest.mark.parametrize("kernel,axes", [("ring", dict(data=2, context=4)),
                                         ("allgather", dict(data=4, context=2))])
def test_gemma2_window_softcap_scale_matches_one_device(kernel, axes):
    """Gemma 2 (the transformers fixture): sliding windows of 5 tokens on alternate layers,
    soft-capped scores, query_pre_attn_scalar; sequences of 16 tokens, so the window crosses
    chunks and shards (context=4: chunks of 2 tokens, and the ring skips the blocks wholly
    outside the window), packed documents on the ring."""
    from fiddlejax import models

    model = models.from_pretrained(Path(__file__).parent / "fixtures" / "hf_gemma2",
                                   seq_len=SEQ)
    cfg = model.config
    assert cfg.sliding_window == 5 < SEQ and cfg.attn_logit_softcapping is not None
    assert cfg.attention_scale is not None and len(cfg.kinds) == 2
    # ids from 1: the fixture's pad row 0 is all zeros (see test_hf_families)
    batch = packed(7, 4) if kernel == "ring" else tokens(7, 4, SEQ, 64)
    batch["tokens"] = 1 + np.asarray(batch["tokens"])
    assert_exact(model, fj.Plan(mesh=fj.make_mesh(**axes), context_kernel=kernel), batch)


def test_unknown_attention_option_is_refused_by_name():
    split = context.Split(size=2, seq=8, mesh=fj.make_mesh(data=4, context=2))
    x = np.zeros((8, 2, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"sets \['bias'\].*mesh context=1"):
        context.Joining(split).attention(x, x, x, causal=True, window=3, bias=1.0)


def test_split_keeps_targets_and_balances_chunks():
    """Shard i holds chunks i and 2C-1-i, each with its next token; positions are global."""
    split = context.Split(size=2, seq=8, mesh=fj.make_mesh(data=4, context=2))
    batch = {"tokens": np.arange(18, dtype=np.int32).reshape(2, 9)}
    rows = jax.jit(lambda b: context.split_batch(b, split))(batch)
    t = np.asarray(rows["tokens"])
    # rows: (shard, sequence, half); chunks of n = 2 tokens, each with its target
    assert t.tolist()[:4] == [[0, 1, 2], [6, 7, 8], [9, 10, 11], [15, 16, 17]]
    assert t.tolist()[4:] == [[2, 3, 4], [4, 5, 6], [11, 12, 13], [13, 14, 15]]
    assert np.asarray(rows["positions"])[1].tolist() == [6, 7, 8]


def test_ring_blocks_balance():
    """Every shard computes 3 + 2 (C - 1) visible n x n blocks (the ring's causal balance)."""
    for c in (2, 4, 8):
        per_shard = []
        for i in range(c):
            mine = [i, 2 * c - 1 - i]
            blocks = 0
            for step in range(c):
                j = (i - step) % c
                theirs = [j, 2 * c - 1 - j]
                blocks += sum(qc >= kc for qc in mine for kc in theirs)  # visible blocks
            per_shard.append(blocks)
        assert per_shard == [3 + 2 * (c - 1)] * c, per_shard


def test_ring_skips_only_blocks_outside_the_window():
    """A ring block is skipped exactly when no shard has a query within the window of a key
    in it (brute force over places); at 128k on context=8 with a 4096-token window (n = 8192)
    a shard computes 5 blocks, not 17."""
    from fiddlejax.parallel import ring

    for c, n, window in [(2, 4, 3), (4, 2, 5), (4, 4, 4), (8, 8, 9), (8, 8, 1)]:
        shard = np.arange(c)
        for step in range(c):
            for qi, ki in ring._blocks(c, step, True, shard):
                seen = False
                for i in range(c):
                    j = (i - step) % c
                    q_early = qi == 0 if isinstance(qi, int) else qi[i]
                    k_early = ki == 0 if isinstance(ki, int) else ki[i]
                    qc = i if q_early else 2 * c - 1 - i
                    kc = j if k_early else 2 * c - 1 - j
                    ahead = (qc * n + np.arange(n))[:, None] - (kc * n + np.arange(n))[None]
                    seen |= bool(((ahead >= 0) & (ahead < window)).any())
                assert ring._in_window(c, n, step, qi, ki, window) == seen, (c, step, qi, ki)
    blocks = sum(ring._in_window(8, 8192, s, qi, ki, 4096)
                 for s in range(8) for qi, ki in ring._blocks(8, s, True, np.arange(8)))
    assert blocks == 5


def test_refusals(llama):
    with pytest.raises(ValueError, match="seq_len=24 or 16"):
        fj.parallelize(Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, seq_len=20),
                             rngs=nnx.Rngs(0)),
                       optax.sgd(0.1), fj.Plan(mesh=fj.make_mesh(data=2, context=4)))
    with pytest.raises(ValueError, match="mesh context=1"):
        trainer = fj.parallelize(llama, optax.sgd(0.1),
                                 fj.Plan(mesh=fj.make_mesh(data=4, context=2)))
        batch = {**tokens(0, 4, SEQ, 64), "weights": np.ones((4,), np.float32)}
        trainer.loss_and_grads(trainer.init(), batch)


def test_checkpoint_restores_across_context_sizes(llama, tmp_path):
    """Nothing is stored per context shard: a state saved on context=2 restores on context=4
    (and trains there from the same numbers)."""
    src = fj.parallelize(llama, optax.adamw(1e-3), fj.Plan(mesh=fj.make_mesh(data=4, context=2)))
    dst = fj.parallelize(llama, optax.adamw(1e-3), fj.Plan(mesh=fj.make_mesh(data=2, context=4)))
    state = src.init()
    with fj.CheckpointManager(tmp_path, src) as m:
        m.save(1, state)
        m.wait()
    with fj.CheckpointManager(tmp_path, dst) as m:
        restored = m.restore()
    assert rel_err(dst.params(restored), src.params(state)) == 0.0
    assert restored.params is not None and restored.step == state.step


@pytest.mark.parametrize("axes", [dict(data=4, tensor=2), dict(data=2, context=2, tensor=2)])
def test_sequence_parallel_matches_one_device(llama, axes):
    """Megatron-SP: norms and the residual stream split over tensor along the sequence."""
    plan = fj.Plan(mesh=fj.make_mesh(**axes), sequence_parallel=True)
    assert_exact(llama, plan, packed(5, 4) if "context" in axes else tokens(5, 4, SEQ, 64))


def test_sequence_parallel_refusals(llama):
    with pytest.raises(ValueError, match="tensor=1"):
        fj.Plan(mesh=fj.make_mesh(data=8), sequence_parallel=True)
    odd = nnx.eval_shape(lambda: Llama(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, seq_len=20), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="20 tokens, not a multiple of 8"):
        fj.parallelize(odd, optax.sgd(0.1),
                       fj.Plan(mesh=fj.make_mesh(data=1, tensor=8), sequence_parallel=True,
                               rules={"heads": None, "kv_heads": None}))


def test_planner_models_context_and_sequence_parallelism():
    """The planner divides activations by context (the ring keeps no whole-sequence scores),
    splits the replicated ones over tensor with sequence parallelism, and its search splits
    long sequences: Llama-3-8B at 32k tokens on one 8 x H100 node."""
    from fiddlejax.planner import Layout, cluster, memory, preset, search

    m = preset("llama3-8b", seq=32768)
    base = dict(tensor=4, global_batch=1, precision="bf16-mixed", remat="full")
    one, four = memory(m, Layout(**base)), memory(m, Layout(**base, context=4))
    assert four.activations == pytest.approx(one.activations / 4)
    sp = memory(m, Layout(**base, sequence_parallel=True))
    # remat=full keeps each layer's input, 2 bytes x hidden per token, replicated over tensor
    removed = m.num_layers * m.seq_len * m.hidden * 2 * (1 - 1 / 4)
    assert one.activations - sp.activations == pytest.approx(removed)
    # with XLA's attention (its s x s scores) the search splits the sequence over context;
    # cuDNN's fused attention (bf16 on a GPU: attention="auto") keeps no scores, and at 32k
    # tensor=8 with sequence parallelism fits without the ring
    best = search(m, cluster("h100", nodes=1), 1, precision="bf16-mixed",
                  microbatch_sizes=(1,), top=3, attention="xla")
    assert best[0].layout.context > 1 and best[0].layout.sequence_parallel
    assert best[0].memory.total < cluster("h100").memory_budget
    fused = search(m, cluster("h100", nodes=1), 1, precision="bf16-mixed",
                   microbatch_sizes=(1,), top=1)[0]
    assert fused.to_dict()["attention"] == "fused" and fused.layout.sequence_parallel
    assert fused.time.total < best[0].time.total and fused.fits


def test_short_sequences_context4_holds_no_more_than_data_parallelism():
    """At 256 tokens (64 per shard) data=2 x context=4 compiles to no more peak memory per
    device than data=8 at the same batch, and the planner never splits so short a sequence."""
    from fiddlejax.planner import cluster
    from fiddlejax.planner import llama as spec
    from fiddlejax.planner.search import candidates

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      seq_len=256)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    peak = {c: fj.parallelize(model, optax.adamw(1e-3), fj.Plan(
        mesh=fj.make_mesh(data=8 // c, context=c))).memory(8)["peak_bytes"] for c in (1, 4)}
    assert peak[4] <= peak[1], peak
    m = spec(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, seq=256, vocab=256)
    assert {lay.context for lay in candidates(m, cluster("h100"), 8)} == {1}


def test_gpt_learned_positions_context2_tensor2():
    """GPT's learned position embeddings read the global positions the split carries."""
    from fiddlejax.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_heads=4, n_layers=2,
                          d_ff=64), rngs=nnx.Rngs(0))
    assert_exact(model, fj.Plan(mesh=fj.make_mesh(data=2, context=2, tensor=2)),
                 tokens(6, 4, SEQ, 64))


def test_long_context_benchmark_compiles_for_mock_gpus(monkeypatch):
    """The GPU row of benchmarks/long_context.py: XLA's GPU compiler with 8 mock GPUs (one
    real), the job's GPU flags, no autotuning; the CPU row: 8 simulated CPU devices."""
    import importlib.util

    from fiddlejax.app import xla_flags

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its `import reporting`, in any test order
    spec = importlib.util.spec_from_file_location("long_context_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gpu = bench.compile_env("gpu")
    assert (gpu["JAX_PLATFORMS"], gpu["JAX_MOCK_GPU_TOPOLOGY"]) == ("cuda", "1x8x1")
    flags = gpu["XLA_FLAGS"].split()
    assert "--xla_gpu_autotune_level=0" in flags
    assert all(f"--{k}={v}" in flags for k, v in xla_flags.GPU_FLAGS.items())
    cpu = bench.compile_env("cpu")
    assert cpu["JAX_PLATFORMS"] == "cpu" and "JAX_MOCK_GPU_TOPOLOGY" not in cpu
    assert "--xla_force_host_platform_device_count=8" in cpu["XLA_FLAGS"].split()


@pytest.mark.parametrize("window", [3, None])
def test_ring_skips_whole_steps_and_stays_exact(window):
    """The ring on one device (``keep`` the identity), values and gradients against plain
    causal attention over the whole sequence; with a window of 3 tokens on chunks of 2 the
    ring runs steps [0, 1, 3] of 4 (the keys jump two shards in one transfer, the key and
    value gradients travel the rest of the way home in one)."""
    from fiddlejax.parallel import ring

    c, b, n, h, kv, dh = 4, 1, 2, 4, 2, 8
    steps = [s for s, _ in ring._steps(c, n, flash.Mode(True, window, None, None))]
    assert steps == ([0, 1, 3] if window else [0, 1, 2, 3])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(c, b, 2, n, heads, dh)), jnp.float32)
               for heads in (h, kv, kv))
    seg = jnp.ones((c, b, 2, n), jnp.int32)
    chunk = np.stack([np.arange(c), 2 * c - 1 - np.arange(c)], 1)  # [c, 2]
    place = (chunk[:, :, None] * n + np.arange(n)).reshape(-1)  # (shard, half, t) -> place
    order = np.argsort(place)

    def whole(x):  # [c, b, 2, n, ...] -> [b, T, ...] in sequence order
        x = jnp.moveaxis(x, 1, 0).reshape(b, 2 * c * n, *x.shape[4:])
        return x[:, order]

    def reference(q, k, v):
        qg, kg, vg = whole(q), whole(k), whole(v)
        t = np.arange(2 * c * n)
        ok = t[:, None] >= t[None]
        if window:
            ok &= t[:, None] - t[None] < window
        s = jnp.einsum("bqhd,bshd->bhqs", qg, jnp.repeat(kg, h // kv, 2)) * dh ** -0.5
        p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), -1)
        out = jnp.einsum("bhqs,bshd->bqhd", p, jnp.repeat(vg, h // kv, 2))
        return out[:, np.argsort(order)].reshape(b, c, 2, n, h, dh).swapaxes(0, 1)

    def ringed(q, k, v):
        return ring.ring_attention(q, k, v, seg, True, lambda x: x, window=window)

    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    want = jax.vjp(reference, q, k, v)
    got = jax.vjp(ringed, q, k, v)
    assert_close(got[0], want[0])
    for g, w in zip(got[1](cot), want[1](cot), strict=True):
        assert_close(g, w)


def test_ring_sends_nothing_for_skipped_steps():
    """On 4 devices, a window of 3 tokens on chunks of 2: the forward sends K, V and segment
    ids twice (to steps 1 and 3), not three times; forward and backward 18 transfers, not 26."""
    import re

    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fiddlejax.parallel import ring

    mesh = jax.make_mesh((4,), ("context",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:4])
    on = NamedSharding(mesh, P("context"))
    keep = lambda x: jax.lax.with_sharding_constraint(x, on)  # noqa: E731
    q = jax.ShapeDtypeStruct((4, 1, 2, 2, 4, 8), jnp.float32, sharding=on)
    k = jax.ShapeDtypeStruct((4, 1, 2, 2, 2, 8), jnp.float32, sharding=on)
    seg = jax.ShapeDtypeStruct((4, 1, 2, 2), jnp.int32, sharding=on)
    counts = {}
    for window in (None, 3):
        def fwd(q, k, v, s, window=window):
            return ring.ring_attention(q, k, v, s, True, keep, window=window)

        def both(q, k, v, s, fwd=fwd):
            return jax.grad(lambda *a: fwd(*a, s).sum(), argnums=(0, 1, 2))(q, k, v)

        counts[window] = [len(re.findall(r" collective-permute(?:-start)?\(",
                                         jax.jit(f).lower(q, k, k, seg).compile().as_text()))
                          for f in (fwd, both)]
    assert counts == {None: [9, 26], 3: [6, 18]}, counts


class _UserBlock(nnx.Module):
    """A user's block: takes no ``ops``, calls the library's attention (reached by interception)."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.3)
        self.wqkv = nnx.Param(init(rngs.params(), (3, 16, 2, 8)))

    def __call__(self, x):
        from fiddlejax.models.common import attention

        q, k, v = (jnp.einsum("btd,dhk->bthk", x, w) for w in self.wqkv[...])
        return x + attention(q, k, v, causal=True).reshape(x.shape)


class _UserLM(nnx.Module):
    stack = "blocks"

    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.initializers.normal(0.5)(rngs.params(), (64, 16)))
        self.blocks = stacked(2, _UserBlock, rngs)

    def batch_spec(self, batch_size):
        return {"tokens": jax.ShapeDtypeStruct((batch_size, SEQ + 1), jnp.int32)}

    def prologue(self, batch):
        return jnp.take(self.embed[...], batch["tokens"][:, :-1], axis=0)

    def head(self, x):
        return x @ self.embed[...].T

    def loss(self, logits, batch):
        labels = batch["tokens"][:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_a_user_block_without_ops_joins_the_shards():
    """A user's staged model whose blocks call ``fiddlejax.models.common.attention`` without
    taking ``ops`` (the one interception reaches them) is exact on data=2 x context=4."""
    model = _UserLM(nnx.Rngs(0))
    assert_exact(model, fj.Plan(mesh=fj.make_mesh(data=2, context=4)), tokens(3, 4, SEQ, 64))


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_join_the_softmax_once(window):
    """GPT-OSS's sinks on both kernels (one device, ``keep`` the identity): values and
    gradients (the sinks' included) equal the single-device softmax with the sink column."""
    from fiddlejax.models.common import capped_attention
    from fiddlejax.parallel import ring

    c, b, n, h, kv, dh = 2, 1, 2, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(c, b, 2, n, heads, dh)), jnp.float32)
               for heads in (h, kv, kv))
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    seg = jnp.ones((c, b, 2, n), jnp.int32)
    chunk = np.stack([np.arange(c), 2 * c - 1 - np.arange(c)], 1)
    order = np.argsort((chunk[:, :, None] * n + np.arange(n)).reshape(-1))

    def whole(x):
        return jnp.moveaxis(x, 1, 0).reshape(b, 2 * c * n, *x.shape[4:])[:, order]

    def reference(q, k, v, s):
        out = capped_attention(whole(q), whole(k), whole(v), causal=True, segment_ids=None,
                               window=window, softcap=None, scale=None, sinks=s)
        return out[:, np.argsort(order)].reshape(b, c, 2, n, h, dh).swapaxes(0, 1)

    kernels = (lambda q, k, v, s: ring.ring_attention(q, k, v, seg, True, lambda x: x,
                                                      window=window, sinks=s),
               lambda q, k, v, s: ring.gathered_attention(q, k, v, seg, True, lambda x: x,
                                                          lambda x: x, window=window, sinks=s))
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    want = jax.vjp(reference, q, k, v, sinks)
    for kernel in kernels:
        got = jax.vjp(kernel, q, k, v, sinks)
        assert_close(got[0], want[0])
        assert_close(got[1](cot), want[1](cot))
