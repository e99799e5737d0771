"""The import graph: the library stands apart from the app and the example models.

``fiddlejax/`` outside ``fiddlejax/app/`` never imports the bundled models (``fiddlejax.models``,
``fiddlejax/models/``; statically, anywhere in a module, and at run time when every
library module is imported), so the library can be used and tested without the examples; the app
reaches models only through ``fiddlejax.models.REGISTRY``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "fiddlejax"
APP = LIBRARY / "app"
MODELS = LIBRARY / "models"


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)  # and `from pkg import mod` as pkg.mod
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def is_models(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in ("models", "fiddlejax.models"))


def library_files() -> list[Path]:
    return [p for p in sorted(LIBRARY.rglob("*.py"))
            if APP not in p.parents and MODELS not in p.parents]


def test_library_never_imports_models():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if is_models(m))
           for p in library_files()}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_app_reaches_models_only_through_the_registry():
    """The app names no model module: what it knows of a model is a registry entry."""
    for p in sorted(APP.rglob("*.py")):
        mods = {m for m in imported_modules(p) if is_models(m)}
        assert mods <= {"fiddlejax.models"}, (p.name, mods)


def test_importing_every_library_module_loads_no_model():
    """At run time too (a fresh interpreter): nothing in the library pulls ``models`` in."""
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in library_files()]
    names = [n.removesuffix(".__init__") for n in names]
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n    importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'models'\n"
            "             or m.startswith('fiddlejax.models')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_registry_entries_build_feed_and_count_every_model():
    """Each model the job trains: built from the default config, fed batches its batch_spec
    accepts, with positive FLOPs and Muon dims on block matrices only."""
    import jax
    import numpy as np
    from flax import nnx
    from optax.contrib import MuonDimensionNumbers

    from fiddlejax import models
    from fiddlejax.app import config

    for name, entry in models.REGISTRY.items():
        cfg = config.load(None, [f"model.name={name}", "model.n_layers=1", "model.seq_len=16",
                                 "model.d_model=32", "model.d_ff=32", "model.channels=8",
                                 "data.batch_size=8"])
        model = entry.build(cfg["model"], 0)
        data = entry.batches(cfg, model, 0, 1)
        batch, spec = next(data.train), model.batch_spec(8)
        assert {k: (np.shape(v), np.dtype(v.dtype)) for k, v in batch.items()} == \
            {k: (s.shape, np.dtype(s.dtype)) for k, s in spec.items()}, name
        assert entry.flops_per_step(model, 8) > 0 and data.items_per_step > 0
        dims = entry.muon_dims(nnx.state(model, nnx.Param))
        muon = jax.tree_util.tree_leaves_with_path(
            dims, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        kept = {".".join(k.key for k in p[1:] if hasattr(k, "key"))
                for p, d in muon if isinstance(d, MuonDimensionNumbers)}
        assert kept == set(entry.muon_axes), (name, kept)
        assert all(p[0].key == "blocks" for p, d in muon if isinstance(d, MuonDimensionNumbers))


# Private reads still waiting for a public entry point (remove when it lands).
PENDING: set = set()  # (file, attribute) reads still waiting for a public entry point


def private_trainer_reads(path: Path) -> set[str]:
    """``trainer._x`` / ``tr._x`` / ``<...>.pipeline._x`` attribute reads in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if "trainer" in name.lower() or name in ("tr", "pipeline"):
            out.add(node.attr)
    return out


def test_nothing_outside_the_library_reads_trainer_internals():
    """Benchmarks and tests use the Trainer's public entry points (compiled_step, lower_step,
    step_function, stage_flops, pipeline, ...), so the Trainer can change inside."""
    found = {(str(p.relative_to(ROOT)), attr)
             for folder in ("benchmarks", "tests", "launch", "docs")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for attr in private_trainer_reads(p)}
    assert found <= PENDING, sorted(found - PENDING)


# Where trace-time state may live: the one interception of users' unmodified models, and gist's
# user-facing selection for a user's own code (it must key JAX's trace caches, hence a jax user
# context; fiddlejax never sets it: a plan's encodings reach models as ops.encodings).
CHANNEL_OWNERS = {"fiddlejax/intercept.py", "fiddlejax/memory/gist.py"}
CHANNELS = ("threading.local", "ContextVar(", "make_user_context(")


def test_no_hidden_channel_reaches_a_block():
    """Parallel services reach blocks as the ``ops`` argument and data as the message: no
    thread-local, ContextVar or jax user context outside the declared owners, no module
    ``global`` rebound at trace time, and the bundled blocks declare ``ops``."""
    found = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for channel in CHANNELS:
            if channel in text and rel not in CHANNEL_OWNERS:
                found.setdefault(rel, []).append(channel)
        tree = ast.parse(text)
        if any(isinstance(n, ast.Global) for n in ast.walk(tree)) and not rel.startswith(
                "fiddlejax/distributed/"):  # the process's runtime, not a trace-time channel
            found.setdefault(rel, []).append("global")
    assert not found, found
    for block in ("common.py", "decoder.py", "moe_lm.py"):  # the bundled blocks take `ops`
        text = (MODELS / block).read_text()
        assert "ops: Ops | None = None) -> Message" in text, block
    assert "x: jax.Array, ops: Ops | None = None) -> jax.Array" in (MODELS / "cnn.py").read_text()
    setters = [p.relative_to(ROOT).as_posix() for p in sorted(LIBRARY.rglob("*.py"))
               if p.name != "gist.py" and re.search(r"gist\.(encodings|with_encodings)\(",
                                                    p.read_text())]
    assert not setters, setters  # the plan's encodings travel as ops.encodings, not a context


def test_each_parallel_concern_is_one_typed_step_the_fold_holds_to_its_word():
    """``compose.lay_out`` folds :data:`CONCERNS`; each declares the mesh axis it serves, the
    draft fields it writes and the ``Ops`` service it offers, and the fold refuses a concern
    that writes a field it did not declare (the declaration cannot drift from the code)."""
    import dataclasses

    import pytest

    from fiddlejax.parallel import compose, concern, ops

    services = {f.name for f in dataclasses.fields(ops.Ops)}
    axes = {"", "data", "pipe", "tensor", "context", "expert"}
    for c in compose.CONCERNS:
        assert c.axis in axes and c.sets <= set(concern.FIELDS), type(c).__name__
        assert c.offers is None or c.offers in services, type(c).__name__
    assert {c.offers for c in compose.CONCERNS} - {None} == services  # every service offered
    assert [type(c).__name__ for c in compose.CONCERNS].index("Pipe") < [
        type(c).__name__ for c in compose.CONCERNS].index("Store")  # FSDP sees the stages

    class Sneaky:
        axis, sets, offers = "tensor", frozenset({"staged"}), None

        def apply(self, draft):
            return dataclasses.replace(draft, specs={"w": None})

    draft = concern.Draft(None, "M", {}, {}, None, None, staged=object())
    with pytest.raises(TypeError, match=r"Sneaky wrote \['specs'\] but declares"):
        concern.fold((Sneaky(),), draft)
    assert concern.fold((), draft) is draft


def test_the_interception_serves_only_users_unmodified_models():
    """The one interception carries what an unmodified user model cannot take as an argument
    (stand-ins, the unrolled scan, dropout keys, ops for blocks without the keyword), nothing
    for the bundled models: their prologue, head and loss take zero=3's vocabulary slices as
    ``ops`` (``ops.vocab``), as their blocks take the layout's other services."""
    import dataclasses
    import inspect

    from fiddlejax import intercept
    from fiddlejax.models.decoder import Decoder
    from fiddlejax.parallel.ops import Ops

    fields = {f.name for f in dataclasses.fields(intercept.Interception)}
    assert fields == {"standins", "unroll_scan", "scan_calls", "dropout", "ops"}, fields
    assert "vocab" in {f.name for f in dataclasses.fields(Ops)}
    for method in ("prologue", "head", "loss"):
        assert "ops" in inspect.signature(getattr(Decoder, method)).parameters, method
