"""What a save and a restore hold beside the training state (issue 45): the conversion to
the canonical layout hands back the leaves it leaves alone instead of copying them, and an
asynchronous save still writes the state as it was when a donating step follows at once."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2)  # 61: padded under tensor=2


def _trainer(**mesh) -> fj.Trainer:
    plan = fj.Plan(mesh=fj.make_mesh(**mesh, devices=jax.devices()[:4]), zero=3)
    return fj.parallelize(Llama(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-2), plan)


def test_the_saves_conversion_copies_only_the_leaves_it_changes():
    """zero=3 over data=4: every leaf is already canonical (forwarded, no copy); with
    tensor=2 the vocabulary is padded, so the embedding, the head and their moments are converted
    (copied), the rest forwarded. Either way the values and shardings equal a plain
    ``jax.jit`` of the conversion, both ways."""
    for mesh, converted in (({"data": 4}, 0), ({"data": 2, "tensor": 2}, 6)):
        t = _trainer(**mesh)
        state = t.init()
        to_canonical, to_internal = t.state_converters()
        out = to_canonical(state)
        held = {id(x) for x in jax.tree.leaves(state)}
        leaves = jax.tree.leaves(out)
        assert sum(id(x) not in held for x in leaves) == converted, mesh
        for a, b in zip(leaves, jax.tree.leaves(to_canonical.copied(state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        back = to_internal(out)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        public = t.to_canonical_state(state)  # a user's copy survives the donating step
        assert not {id(x) for x in jax.tree.leaves(public)} & held


def test_an_async_save_followed_by_a_donating_step_writes_the_saved_state(tmp_path):
    t = _trainer(data=4)
    state = t.init()
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 9), 0, 61), np.int32)
    want = jax.tree.map(np.asarray, t.params(state))
    with fj.CheckpointManager(tmp_path, t, async_save=True) as m:
        m.save(1, state, force=True)
        state, _ = t.step(state, {"tokens": tokens})  # donates the arrays being written
        jax.block_until_ready(state)
    with fj.CheckpointManager(tmp_path, t, read_only=True) as m:
        got = t.params(m.restore(1))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert not all(np.array_equal(np.asarray(a), b) for a, b in zip(
        jax.tree.leaves(t.params(state)), jax.tree.leaves(want)))  # the step did move them


def test_a_bounded_snapshot_saves_the_same_state(tmp_path):
    """``snapshot_gb`` bounds how much of a save's device-to-host snapshot (Orbax's
    save_device_host_concurrent_gb) and of its writes (save_concurrent_gb) the host holds at
    once; a bound below the largest array is raised
    to it (Orbax refuses an array above its bound), and the restored state is the saved one."""
    from fiddlejax.checkpoint import stored

    t = _trainer(data=4)
    largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(t.abstract_state()))
    assert stored.snapshot_bound(None, t) is None
    assert stored.snapshot_bound(1e-9, t) == (largest + 1) / 1e9
    assert stored.snapshot_bound(5, t) == 5.0
    assert stored.snapshot_limits(None, t) == {}  # the write path bounded as the snapshot
    assert stored.snapshot_limits(5, t) == {"save_device_host_concurrent_gb": 5.0,
                                            "save_concurrent_gb": 5.0}
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match=f"snapshot_gb={bad!r} must be a positive"):
            fj.CheckpointManager(tmp_path / "bad", t, snapshot_gb=bad)
    state = t.init()
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 9), 0, 61), np.int32)
    state, _ = t.step(state, {"tokens": tokens})
    want = jax.tree.map(np.asarray, t.to_canonical_state(state))
    with fj.CheckpointManager(tmp_path, t, snapshot_gb=1e-9) as m:
        m.save(1, state, force=True)
    with fj.CheckpointManager(tmp_path, t, read_only=True) as m:
        got = t.to_canonical_state(m.restore(1))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_step_compiled_apart_runs_as_the_jitted_one():
    """``precompile`` (the job compiles its first step so, then returns the compiler's freed
    memory before the step runs): ``step`` runs that executable for batches of its shape, with
    the same losses and parameters as a trainer that compiles on the call; another shape falls
    back to the jitted step."""
    from fiddlejax.app import host_memory

    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 9), 0, 61), np.int32)
    ours, theirs = _trainer(data=4), _trainer(data=4)
    a, b = ours.init(), theirs.init()
    ours.precompile(ours.abstract_state(), {"tokens": tokens})
    (executable,) = ours._compiled.values()
    calls = []
    ours._compiled = {k: lambda *args: calls.append(1) or executable(*args)
                      for k in ours._compiled}
    assert host_memory.map_large_blocks() and isinstance(host_memory.release(), bool)
    for batch in (tokens, tokens[:, ::-1], tokens[:, :5]):  # the last: another shape
        a, ma = ours.step(a, {"tokens": np.ascontiguousarray(batch)})
        b, mb = theirs.step(b, {"tokens": np.ascontiguousarray(batch)})
        assert float(ma["loss"]) == float(mb["loss"])
    assert len(calls) == 2
    for x, y in zip(jax.tree.leaves(ours.params(a)), jax.tree.leaves(theirs.params(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
