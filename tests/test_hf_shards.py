"""Hugging Face checkpoints at real size (issue 45): loaded by the slices each device holds,
written tensor by tensor from sharded parameters, hub ids resolved from the local cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fiddlejax as fj
from fiddlejax.models import from_pretrained, hf_io, hub
from fiddlejax.models.hf import read_safetensors
from fiddlejax.models.llama import Llama, LlamaConfig


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small bf16 Llama directory in two shard files."""
    c = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                    seq_len=16)
    model = Llama(c, rngs=nnx.Rngs(3))
    d = tmp_path_factory.mktemp("llama")
    model.save_pretrained(d, dtype="bfloat16", max_shard_size="40KB")
    assert (d / hf_io.INDEX).is_file()
    return d


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def _shardings(model):
    """Each leaf split over ``a`` (4) on its first dimension that 4 divides (layers, rows) and
    over ``b`` (2) on its last (columns), or its heads as tensor parallelism splits them."""
    mesh = _mesh()

    def spec(v):
        axes = [None] * len(v.shape)
        axes[-2 if len(v.shape) == 4 and v.shape[-1] == 8 else -1] = "b"  # heads, not head_dim
        first = next((i for i, n in enumerate(v.shape[:-1]) if n % 4 == 0), None)
        if first is not None:
            axes[first] = "a"
        return NamedSharding(mesh, P(*axes))

    return jax.tree.map(spec, nnx.state(model, nnx.Param))


def test_sharded_load_reads_only_each_shard_and_equals_the_whole_read(saved, monkeypatch):
    whole = from_pretrained(saved)
    abstract = from_pretrained(saved, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    got = {k: v.size for k, v in read_safetensors(saved).items()}
    read = []
    original = hf_io.Stored.read
    monkeypatch.setattr(hf_io.Stored, "read", lambda self, index: read.append(
        (self.name, original(self, index).size)) or original(self, index))
    params = abstract.pretrained_params(_shardings(abstract))
    per_tensor: dict = {}
    for name, n in read:
        per_tensor[name] = per_tensor.get(name, 0) + n
    assert per_tensor == got  # every element read once: each device its own block, no more
    for (_, a), (_, b) in zip(nnx.to_flat_state(params), nnx.to_flat_state(
            nnx.state(whole, nnx.Param))):
        assert len(a[...].sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))


def test_save_from_sharded_parameters_writes_the_same_files(saved, tmp_path):
    model = from_pretrained(saved, shardings=_shardings(from_pretrained(saved, abstract=True)))
    model.save_pretrained(tmp_path / "out", max_shard_size="40KB")
    a, b = read_safetensors(saved), read_safetensors(tmp_path / "out")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint16),
                                                           b[k].view(np.uint16)), k
    index = json.loads((tmp_path / "out" / hf_io.INDEX).read_text())
    assert set(index["weight_map"]) == set(a) and len(set(index["weight_map"].values())) > 1


def test_trainer_init_takes_a_loader_and_refuses_an_abstract_model(saved):
    plan = fj.Plan(mesh=fj.make_mesh(data=8, pipe=1, tensor=1), zero=3)
    whole = from_pretrained(saved)
    expected = fj.parallelize(whole, optax.adamw(1e-3), plan).init()
    abstract = from_pretrained(saved, abstract=True)
    trainer = fj.parallelize(abstract, optax.adamw(1e-3), plan)
    with pytest.raises(ValueError, match="abstract.*pretrained_params"):
        trainer.init()
    state = trainer.init(abstract.pretrained_params)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _fake_cache(root, repo: str, source) -> None:
    """``repo`` in a Hugging Face cache laid out as the hub does."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    snap = base / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in source.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("0123abcd")


def test_hub_ids_resolve_from_the_local_cache_only(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fake_cache(tmp_path / "cache", "meta-llama/Tiny-Test", saved)
    path = hub.local_dir("meta-llama/Tiny-Test")
    assert path == tmp_path / "cache" / "models--meta-llama--Tiny-Test" / "snapshots" / "0123abcd"
    model = from_pretrained("meta-llama/Tiny-Test")
    np.testing.assert_array_equal(np.asarray(model.embed[...]),
                                  np.asarray(from_pretrained(saved).embed[...]))
    from fiddlejax.app import config

    cfg = config.load(None, ["model.from_pretrained=meta-llama/Tiny-Test"])
    assert cfg["model"]["from_pretrained"] == str(path) and cfg["model"]["name"] == "llama"
    with pytest.raises(FileNotFoundError, match="meta-llama/Absent.*local Hugging Face cache"
                                                ".*hf download meta-llama/Absent"):
        hub.local_dir("meta-llama/Absent")
    with pytest.raises(config.ConfigError, match="never downloads"):
        config.load(None, ["model.from_pretrained=meta-llama/Absent"])
    assert hub.local_dir(str(saved)) == saved  # a directory is itself


def test_init_from_a_hugging_face_directory_returns_a_slice_loader(saved, monkeypatch):
    """``init_from=<HF dir>`` reads nothing whole: it checks the shapes abstractly and returns
    the loader ``trainer.init`` calls, which reads the same parameters as from_pretrained."""
    from fiddlejax.app import runs

    whole = from_pretrained(saved)
    reads = []
    real = hf_io.Stored.read
    monkeypatch.setattr(hf_io.Stored, "read", lambda self, i: reads.append(1) or real(self, i))
    model = Llama(whole.config, rngs=nnx.Rngs(0))
    what, loader = runs.init_weights({"init_from": str(saved), "model": {"seq_len": 16}},
                                     model, None)
    assert "Hugging Face" in what and not reads  # nothing read before init
    got, want = loader(None), nnx.state(whole, nnx.Param)
    assert reads
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SAVE_ON_TWO_PROCESSES = """
import sys, jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx
from fiddlejax import distributed
from fiddlejax.models import from_pretrained
distributed.initialize()  # FIDDLEJAX_* from the test: 2 processes x 2 CPU devices, gloo
assert jax.process_count() == 2 and jax.device_count() == 4
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
abstract = from_pretrained(sys.argv[1], abstract=True)
shardings = jax.tree.map(  # every leaf split over the 4 devices on its first dimension 4 divides
    lambda v: NamedSharding(mesh, P(*[("data" if i == next(
        (j for j, n in enumerate(v.shape) if n % 4 == 0), None) else None)
        for i in range(len(v.shape))])), nnx.state(abstract, nnx.Param))
model = from_pretrained(sys.argv[1], shardings=shardings)
assert not model.embed[...].is_fully_addressable  # each process holds half of each leaf
model.save_pretrained(sys.argv[2], max_shard_size="40KB")  # collective; process 0 writes
"""


@pytest.mark.slow
def test_save_from_two_processes_writes_the_same_files(saved, tmp_path):
    """Two processes (jax.distributed over 127.0.0.1, gloo), each holding half of every leaf:
    both call save_pretrained, process 0 writes, and the files equal the source bit for bit."""
    import os
    import subprocess
    import sys

    from test_distributed import _free_port, clean_env

    port, out = _free_port(), tmp_path / "out"
    procs = [subprocess.Popen(
        [sys.executable, "-c", SAVE_ON_TWO_PROCESSES, str(saved), str(out)],
        env=clean_env(FIDDLEJAX_COORDINATOR=f"127.0.0.1:{port}", FIDDLEJAX_NUM_PROCESSES="2",
                      FIDDLEJAX_PROCESS_ID=str(rank), FIDDLEJAX_CPU_DEVICES="2",
                      PYTHONPATH=os.pathsep.join(sys.path)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    a, b = read_safetensors(saved), read_safetensors(out)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint16),
                                                           b[k].view(np.uint16)), k


def test_bf16_parameters_read_straight_from_a_bf16_checkpoint(saved):
    """``models.with_param_dtype`` on an abstract model (``model.param_dtype=bfloat16``): the
    loader reads each shard into bf16 (no float32 copy), bit-equal to the checkpoint's
    tensors; AdamW's moments follow; the job's build does the same."""
    import jax.numpy as jnp

    from fiddlejax import models
    from fiddlejax.app import build, config

    plan = fj.Plan(mesh=fj.make_mesh(data=8, pipe=1, tensor=1), zero=3)
    abstract = models.with_param_dtype(from_pretrained(saved, abstract=True), "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))} == {
        jnp.dtype(jnp.bfloat16)}
    state = fj.parallelize(abstract, optax.adamw(1e-3), plan).init(abstract.pretrained_params)
    want = nnx.state(from_pretrained(saved, dtype=jnp.bfloat16), nnx.Param)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}

    cfg = config.load(None, [f"model.from_pretrained={saved}", "model.param_dtype=bfloat16",
                             "model.seq_len=16"])
    model = build.build_model(cfg["model"], 0, weights=False)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert build.initial_params(model) is not None  # still abstract: read by shards at init
    with pytest.raises(config.ConfigError, match="model.param_dtype"):
        config.load(None, ["model.param_dtype=float16"])
