"""What an export reads (issue 45): a checkpoint's parameters one layer at a time from disk,
each array still checked against the fingerprint its save recorded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import fiddlejax as fj
from fiddlejax.checkpoint import manifest, params, stored
from fiddlejax.models.llama import Llama, LlamaConfig


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_])
def test_the_parts_fingerprints_add_up_to_the_saves(dtype):
    """The save's fingerprint is a position-weighted sum: layer by layer at their offsets
    gives the same value as the whole array (every dtype a state holds)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 7)).astype(dtype) if dtype != np.bool_ else rng.random(
        (3, 5, 7)) > 0.5
    whole = int(manifest._fingerprint(jnp.asarray(x)))
    assert stored.fingerprint_part(x, 0) == whole
    parts = sum(stored.fingerprint_part(x[i], i * 35) for i in range(3)) % 2**32
    assert parts == whole
    y = x.copy()
    y[2, 4, 6] = y[2, 4, 5] if dtype != np.bool_ else not y[2, 4, 6]
    if (y != x).any():
        assert stored.fingerprint_part(y, 0) != whole


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    t = fj.parallelize(Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                       fj.Plan(mesh=fj.make_mesh(data=1, devices=jax.devices()[:1])))
    directory = tmp_path_factory.mktemp("ckpt")
    state = t.init()
    with fj.CheckpointManager(directory, t, async_save=False) as m:
        m.save(1, state, force=True)
    return directory, t, jax.tree.map(np.asarray, t.params(state))


def test_a_stacked_leaf_is_read_a_layer_at_a_time_and_checked(saved):
    directory, t, want = saved
    with fj.CheckpointManager(directory, t, read_only=True) as m:
        step, shapes, leaves = params.param_leaves(m)
        w1 = leaves(("blocks", "w1"))
        assert isinstance(w1, stored.StoredArray) and shapes[("blocks", "w1")] == (3, 16, 24)
        for i in (2, 0, 1):  # any order; each layer is one read
            np.testing.assert_array_equal(w1[i], np.asarray(want["blocks"]["w1"])[i])
            assert w1.verified == (i == 1)
        np.testing.assert_array_equal(np.asarray(leaves(("embed",))), want["embed"])
        leaves.check()
        bad = leaves(("blocks", "w2"))
        bad._want ^= 1  # as if its data had changed since the save
        bad[0], bad[1]
        with pytest.raises(ValueError, match=r"is corrupted: params\.blocks\.w2 does not match "
                           r"the fingerprint recorded"):
            leaves.check()
    assert step == 1


def test_a_damaged_file_names_the_array(saved, tmp_path):
    import shutil

    directory, t, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    for f in (copy / "1" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:16])  # every data file cut short
    with fj.CheckpointManager(copy, t, read_only=True) as m:
        _, _, leaves = params.param_leaves(m)
        with pytest.raises(ValueError, match=r"checkpoint step 1 in .* is truncated or "
                           r"corrupted: params\.blocks\.w1 cannot be read"):
            leaves(("blocks", "w1"))[0]


def test_stacked_leaves_are_stored_a_layer_per_chunk_and_older_ones_still_read(
        saved, tmp_path, monkeypatch):
    """Saved by this version, a stacked leaf's storage chunk is one layer (a layer read reads
    that layer alone); a checkpoint whose chunk holds every layer (as Orbax stores a shard by
    default) reads the chunk once and serves its layers from it."""
    directory, t, want = saved
    with fj.CheckpointManager(directory, t, read_only=True) as m:
        w1 = params.param_leaves(m)[2](("blocks", "w1"))
        w1[0]
        assert w1._open().chunk_layout.read_chunk.shape[0] == 1
    import orbax.checkpoint as ocp

    monkeypatch.setattr(stored, "save_args", lambda paths, leaves, staged: [ocp.SaveArgs()
                                                                            for _ in leaves])
    state = t.init()
    with fj.CheckpointManager(tmp_path / "old", t, async_save=False) as m:
        m.save(1, state, force=True)
    with fj.CheckpointManager(tmp_path / "old", t, read_only=True) as m:
        _, _, leaves = params.param_leaves(m)
        w1 = leaves(("blocks", "w1"))
        assert w1._open().chunk_layout.read_chunk.shape[0] == 3
        reads = []
        real = w1._read
        monkeypatch.setattr(w1, "_read", lambda index: reads.append(index) or real(index))
        for i in range(3):
            np.testing.assert_array_equal(w1[i], np.asarray(want["blocks"]["w1"])[i])
        assert reads == [slice(0, 3)] and w1.verified
        leaves.check()
