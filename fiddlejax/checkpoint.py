"""Checkpoints on Orbax: async, layout-portable, verified, preemption-safe, CheckFreq-paced.

Why ``orbax.checkpoint.CheckpointManager`` (the v0 API) and not the v1 training Checkpointer:
v1 is under ``orbax.checkpoint.experimental`` in 0.12.8 and its surface still moves, while the
manager is the stable, documented API that already gives everything we need: async saves whose
blocking part is exactly the device-to-host snapshot (the write runs on a background thread),
atomic commits (a step is written to ``<step>.orbax-checkpoint-tmp-*`` and renamed when complete,
so a crash mid-save leaves only an ignored temporary directory), preservation policies (latest N
plus best N by a metric) and the multi-process preemption sync point.

What is saved, per step directory:

- ``state``: the whole :class:`~fiddlejax.train.TrainState` in the *canonical* layout
  (``Trainer.to_canonical_state``: params as ``nnx.state(model, nnx.Param)`` and every
  param-shaped subtree of the optimizer state likewise), as nested dicts named by tree path
  (``params.blocks.w1``, ``opt_state.1.0.mu.blocks.w1``). Any layout (data, pipe, tensor, virtual
  stages, ZeRO) converts to and from it exactly, so a checkpoint restores onto any other layout:
  Orbax reads each array straight into shardings derived from the target trainer.
- ``meta``: JSON with the model name, every array's shape, dtype and a layout-independent
  fingerprint (a position-weighted sum of its bits, mod 2**32, computed on device), the plan that
  saved it, the job config, the data iterator state, the RNG key and user extras. Restore checks
  names, shapes and dtypes against the target before reading arrays, and fingerprints after, so a
  different model or a corrupted checkpoint fails with an error naming the array.

CheckFreq (Mohan et al., FAST'21; the policy is :mod:`fiddlejax.checkfreq`, SIGTERM handling
:mod:`fiddlejax.preemption`, the ``fiddlejax train`` glue :mod:`fiddlejax.app.checkpoints`): with
``every="auto"`` the manager times every ``save`` call it gets (call it every step): the step
time, the snapshot stall, the background persist time and the slowdown of steps that overlap a
persist, and picks the smallest interval that keeps the measured
cost under ``checkfreq_overhead`` of training time (default 3.5%) and lets each persist finish
before the next snapshot. :meth:`CheckpointManager.stats` reports the overhead actually incurred.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fiddlejax.checkfreq import CheckFreq
from fiddlejax.preemption import Preemption

FORMAT = 1  # bump when the layout of a step directory changes


# -- naming and fingerprints ---------------------------------------------------------------------
def _segment(key) -> str | None:
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        return str(key.key)
    if isinstance(key, tu.GetAttrKey):
        return None if key.name == "value" else key.name  # nnx.Variable's payload: not a level
    if isinstance(key, tu.SequenceKey):
        return str(key.idx)
    if isinstance(key, tu.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def named_leaves(tree) -> tuple[list[tuple[str, ...]], list, Any]:
    """(path segments, leaves, treedef) of ``tree``, paths as strings without Variable levels."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [tuple(s for s in map(_segment, p) if s is not None) for p, _ in flat]
    return paths, [x for _, x in flat], treedef


def _nest(paths: list[tuple[str, ...]], leaves: list) -> dict:
    out: dict = {}
    for path, leaf in zip(paths, leaves):
        d = out
        for s in path[:-1]:
            d = d.setdefault(s, {})
        d[path[-1]] = leaf
    return out


def _lookup(tree: dict, path: tuple[str, ...]):
    for s in path:
        tree = tree[s]
    return tree


def _fingerprint(x: jax.Array) -> jax.Array:
    """A position-weighted sum of the bits of ``x`` mod 2**32.

    Integer addition is associative, so every layout and reduction order gives the same value;
    any single changed element changes it (the weights are odd).
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
        stride = stride * x.shape[d] % 2**32
    weights = index * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * (weights | jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _fingerprints(leaves: list) -> jax.Array:
    return jnp.stack([_fingerprint(x) for x in leaves]) if leaves else jnp.zeros(0, jnp.uint32)


def _name(path: tuple[str, ...]) -> str:
    return ".".join(path)


# -- what a restore returns --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Restored:
    """Everything a checkpoint holds besides (and including) the train state."""

    step: int
    state: Any
    data_state: Any = None
    rng: jax.Array | None = None
    extra: Any = None
    metrics: dict | None = None
    config: dict | None = None
    plan: dict | None = None
    model: str | None = None


# -- the manager ---------------------------------------------------------------------------------
class CheckpointManager:
    """Saves and restores a :class:`~fiddlejax.train.Trainer`'s state, layout-independently.

    - ``every``: save when ``step % every == 0`` (``save`` is a no-op otherwise, unless
      ``force``); ``0`` saves only when forced or preempted; ``"auto"`` picks the interval with
      :class:`CheckFreq` (then call ``save`` every step, it times them).
    - ``max_to_keep`` latest checkpoints are kept, plus the ``keep_best`` best by
      ``metrics[best_metric]`` (``best_mode`` ``"min"`` or ``"max"``) when ``best_metric`` is set.
    - ``async_save``: the write runs in the background after a blocking device-to-host snapshot.
    - ``config``: the job config, stored as metadata (``fiddlejax train`` passes its own).

    Every process calls every method (Orbax writes each process's shards and synchronizes).
    """

    def __init__(self, directory: str | Path, trainer, *, every: int | str = 1,
                 max_to_keep: int | None = 3, best_metric: str | None = None,
                 best_mode: str = "min", keep_best: int = 1, async_save: bool = True,
                 checkfreq_overhead: float = 0.035, config: dict | None = None,
                 preemption: Preemption | None = None):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as cm

        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool)
                                or every < 0):
            raise ValueError(f"every={every!r} must be a step count >= 0 or 'auto' (CheckFreq)")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode={best_mode!r} must be 'min' or 'max'")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep!r} must be >= 1 (or None to keep all)")
        self.directory = Path(directory).absolute()
        self.trainer, self.every, self.config = trainer, every, config
        self.best_metric, self.async_save = best_metric, async_save
        self.preemption = preemption
        self.checkfreq = CheckFreq(checkfreq_overhead) if every == "auto" else None
        self.restored: Restored | None = None

        policies = [cm.LatestN(n=max_to_keep)]
        best_fn = None
        if best_metric is not None:
            def best_fn(m):
                return float(m[best_metric])

            policies.append(cm.BestN(get_metric_fn=best_fn, reverse=best_mode == "min",
                                     n=keep_best, keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            best_fn=best_fn, best_mode=best_mode,
            preservation_policy=cm.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
            async_options=(ocp.AsyncOptions(post_finalization_callback=self._persisted)
                           if async_save else None),
        )
        self._ocp = ocp
        # Replica-parallel writes slice every replicated shard on device first; on CPU that is
        # ~200 tiny dispatches (and compiles) per save, 5x the whole snapshot. Orbax already
        # turns it off on GPU; one replica writes each shard instead.
        arrays = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=arrays),
                           "meta": ocp.JsonCheckpointHandler()})
        # timing, for CheckFreq and stats()
        self._lock = threading.Lock()
        self._t0: float | None = None  # first save() call
        self._last_return: float | None = None
        self._stall = 0.0  # seconds spent blocked in save()
        self._interfered = 0.0  # extra step time while a persist ran (CheckFreq mode)
        self._persist_start: float | None = None
        self._persist_end: float | None = None
        self._pending: int | None = None  # step whose background write may still run
        self._window_extra = 0.0
        self._saves = 0
        self._last_saved: int | None = None

    # -- saving ----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` at ``step`` would write (interval, CheckFreq or preemption)."""
        if self.preemption is not None and self.preemption.reached(step):
            return True
        if self.checkfreq is not None:
            if self.checkfreq.step_time() is None:
                return False
            k = self.checkfreq.interval()
            if k is None:  # profiling: the first, cold save is not a measurement; take another
                return not self._persisting()
            return step - self._last_saved >= k
        return bool(self.every) and step % self.every == 0

    def _persisting(self) -> bool:
        with self._lock:
            return self._persist_start is not None and self._persist_end is None

    def warm_up(self, state) -> None:
        """Compile the save path now, so the first save (maybe a preemption's) is quick."""
        _, leaves, _ = named_leaves(self.trainer.to_canonical_state(state))
        np.asarray(_fingerprints(leaves))

    def save(self, step: int, state, force: bool = False, *, metrics: dict | None = None,
             data_state: Any = None, rng: jax.Array | None = None, extra: Any = None) -> bool:
        """Save ``state`` at ``step`` if due (or ``force``); returns whether it saved.

        ``data_state`` (e.g. a grain iterator's ``get_state()``), ``rng`` (a PRNG key) and
        ``extra`` (anything JSON) come back from :meth:`restore_all`. ``metrics`` rank checkpoints
        for ``best_metric``. The call blocks only for the device-to-host snapshot when async.
        """
        step = int(step)
        if self.checkfreq is not None:  # time steps exactly: wait for the step to finish
            jax.block_until_ready(state.step)
        now = time.perf_counter()
        self._account_step(now)
        if not (force or self.should_save(step)):
            self._last_return = time.perf_counter()
            return False
        latest = self._mngr.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                self._last_return = time.perf_counter()
                return False  # already saved (e.g. a forced final save after a periodic one)
            raise ValueError(f"step={step} is not after the latest checkpoint step {latest} in "
                             f"{self.directory}; steps must increase")
        self._finish_pending()  # Orbax would wait for it anyway; we also check it committed
        self._book_persist()
        canonical = self.trainer.to_canonical_state(state)
        paths, leaves, _ = named_leaves(canonical)
        fps = np.asarray(_fingerprints(leaves))
        meta = self._meta(step, paths, leaves, fps, data_state, rng, extra, metrics)
        ocp = self._ocp
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(_nest(paths, leaves)),
                                  meta=ocp.args.JsonSave(meta))
        with self._lock:
            self._persist_start = self._persist_end = None
        ranked = self.best_metric is not None and self.best_metric in (metrics or {})
        self._mngr.save(step, args=args, metrics=jsonable(metrics) if ranked else None,
                        force=True)
        self._pending, self._last_saved, self._saves = step, step, self._saves + 1
        end = time.perf_counter()
        with self._lock:  # the background write runs from here (or is already done)
            self._persist_start = end
            if not self.async_save:
                self._persist_end = end
        if self.checkfreq is not None and self._saves > 1:  # the first save compiles things
            self.checkfreq.snapshots.append(end - now)
        self._stall += end - now
        if not self.async_save:
            self._pending = None
            self._check_committed(step)
        self._last_return = end
        return True

    def _meta(self, step, paths, leaves, fps, data_state, rng, extra, metrics) -> dict:
        arrays = {_name(p): {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name,
                             "fingerprint": int(f)}
                  for p, x, f in zip(paths, leaves, fps)}
        rng_meta = None
        if rng is not None:
            typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
            data = jax.random.key_data(rng) if typed else rng
            rng_meta = {"typed": bool(typed), "data": np.asarray(data).tolist(),
                        "impl": str(jax.random.key_impl(rng)) if typed else None}
        return {"format": FORMAT, "step": step, "model": self.trainer.model_name,
                "plan": jsonable(self.trainer.plan.describe()), "config": jsonable(self.config),
                "arrays": arrays, "data_state": jsonable(data_state), "rng": rng_meta,
                "extra": jsonable(extra), "metrics": jsonable(metrics), "time": time.time()}

    def _persisted(self) -> None:  # Orbax's post-finalization callback (background thread)
        with self._lock:
            self._persist_end = time.perf_counter()

    def _account_step(self, now: float) -> None:
        """Book the time since the last save() returned as one step (CheckFreq mode).

        A step that overlapped a background write books its excess over the median step time,
        at most the overlap, as that write's interference (signed, so noise averages out).
        """
        if self._t0 is None:
            self._t0 = now
        if self._last_return is None or self.checkfreq is None:
            return
        gap, cf = now - self._last_return, self.checkfreq
        with self._lock:
            start, end = self._persist_start, self._persist_end
        overlap = 0.0
        if start is not None:
            overlap = (now if end is None else min(end, now)) - max(start, self._last_return)
        if overlap <= 0:
            cf.steps.append(gap)
        elif (t := cf.step_time()) is not None:
            self._window_extra += min(gap - t, overlap)
        self._book_persist()

    def _book_persist(self) -> None:
        """Once a background write is over, book its duration and interference (CheckFreq)."""
        with self._lock:
            start, end = self._persist_start, self._persist_end
            if start is None or end is None:
                return
            self._persist_start = None
        extra = max(0.0, self._window_extra)
        self._window_extra = 0.0
        self._interfered += extra
        if self.checkfreq is not None:
            self.checkfreq.persists.append(max(0.0, end - start))
            self.checkfreq.interference.append(extra)

    def stats(self) -> dict:
        """Measured checkpoint costs: overhead share of wall time, interval, last phases."""
        elapsed = (time.perf_counter() - self._t0) if self._t0 is not None else 0.0
        cf = self.checkfreq
        out = {"ckpt_saves": self._saves,
               "ckpt_overhead": (self._stall + self._interfered) / elapsed if elapsed else 0.0,
               "ckpt_stall_s": self._stall, "ckpt_interference_s": self._interfered}
        if cf is not None:
            out["ckpt_every"] = cf.interval() or 0
            if cf.snapshots:
                out["ckpt_snapshot_s"] = cf.snapshots[-1]
            if cf.persists:
                out["ckpt_persist_s"] = cf.persists[-1]
        return out

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._mngr.wait_until_finished()
            error = None
        except Exception as e:  # noqa: BLE001 - reported below with what it means for the user
            error = e
        if self._last_return is not None:  # time spent waiting here is not a training step
            self._last_return = time.perf_counter()
        self._check_committed(step, error)

    def _check_committed(self, step: int, error: Exception | None = None) -> None:
        if error is None and (self.directory / str(step)).is_dir():
            return
        self._mngr.reload()
        cause = f"{type(error).__name__}: {_first_line(error)}" if error else "see Orbax's log"
        raise RuntimeError(
            f"saving checkpoint step {step} to {self.directory} failed ({cause}); the previous "
            f"checkpoint (step {self._mngr.latest_step()}) is intact and is what a resume "
            "will use") from error

    def wait(self) -> None:
        """Block until the last save is on disk; raises if its background write failed."""
        self._finish_pending()

    def close(self) -> None:
        """Wait for the last save, then release Orbax's threads. Idempotent."""
        try:
            self._finish_pending()
        finally:
            self._mngr.close()
            if self.preemption is not None:
                self.preemption.uninstall()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restoring -------------------------------------------------------------------------------
    def reload(self) -> None:
        """Re-read the directory's steps (after another tool moved or removed some)."""
        self._mngr.reload()

    def latest_step(self) -> int | None:
        """The newest committed step (temporary directories of interrupted saves never count)."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def reached_preemption(self, step: int) -> bool:
        return self.preemption is not None and self.preemption.reached(step)

    def restore(self, step: int | None = None):
        """The state saved at ``step`` (default: latest), on this trainer's own layout.

        The rest of the checkpoint (data iterator state, RNG, config, ...) is in
        :attr:`restored` afterwards; :meth:`restore_all` returns it directly.
        """
        return self.restore_all(step).state

    def restore_all(self, step: int | None = None) -> Restored:
        """Restore ``step`` (default: latest) and everything saved with it."""
        self._finish_pending()
        self._mngr.reload()
        if step is None:
            step = self._mngr.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}; save one first or "
                                        "point the manager at the run's checkpoint directory")
        elif step not in self._mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; it has "
                                    f"steps {sorted(self._mngr.all_steps())}")
        where = f"checkpoint step {step} in {self.directory}"
        ocp = self._ocp
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise ValueError(f"{where} is unreadable: its metadata is missing or corrupted "
                             f"({type(e).__name__}: {_first_line(e)}); "
                             f"{self._fallback(step)}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "arrays" not in meta:
            raise ValueError(f"{where} is not a fiddlejax checkpoint of format {FORMAT} "
                             "(its meta item lacks 'format'/'arrays')")
        abstract_state = self._abstract_state()
        to_canonical = self.trainer._state_converters()[0]
        paths, shapes, treedef = named_leaves(jax.eval_shape(to_canonical, abstract_state))
        self._check_compatible(where, meta, paths, shapes)  # before reading any array
        # Read each array straight into the shardings the target's own conversion produces.
        shardings = jax.tree.leaves(to_canonical.lower(abstract_state).compile().output_shardings)
        target = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                  for a, s in zip(shapes, shardings)]
        abstract = _nest(paths, target)
        try:
            restore = ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
            arrays = self._mngr.restore(step, args=ocp.args.Composite(state=restore))["state"]
            leaves = [_lookup(arrays, p) for p in paths]
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{where} is truncated or corrupted: reading its arrays failed "
                             f"({type(e).__name__}: {_first_line(e)}); "
                             f"{self._fallback(step)}") from e
        fps = np.asarray(_fingerprints(leaves))
        for p, got in zip(paths, fps):
            want = meta["arrays"][_name(p)]["fingerprint"]
            if int(got) != want:
                raise ValueError(
                    f"{where} is corrupted: {_name(p)} does not match the fingerprint recorded "
                    f"when it was saved ({int(got)} != {want}); {self._fallback(step)}")
        canonical = jax.tree_util.tree_unflatten(treedef, leaves)
        state = self.trainer.from_canonical_state(canonical)
        self.restored = Restored(
            step=step, state=state, data_state=meta.get("data_state"), rng=_rng(meta.get("rng")),
            extra=meta.get("extra"), metrics=meta.get("metrics"), config=meta.get("config"),
            plan=meta.get("plan"), model=meta.get("model"))
        return self.restored

    def _fallback(self, bad: int) -> str:
        """What to do instead of restoring the damaged step ``bad``."""
        earlier = sorted((s for s in self.all_steps() if s < bad), reverse=True)
        if not earlier:
            return f"no earlier checkpoint is left in {self.directory}; start a fresh run"
        return (f"restore an earlier step: fiddlejax train ... resume={earlier[0]} (Python: "
                f"restore(step={earlier[0]})); earlier steps: {earlier}")

    def _abstract_state(self):
        """This trainer's TrainState as ShapeDtypeStructs carrying its shardings."""
        tr = self.trainer
        abstract = jax.eval_shape(lambda p: tr.init(p), tr._canonical_template)
        return jax.tree.map(  # the shardings tree is a prefix (no Variable levels)
            lambda s, sub: jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub),
            tr.state_shardings, abstract)

    def _check_compatible(self, where, meta, paths, target) -> None:
        model = self.trainer.model_name
        if meta.get("model") != model:
            raise ValueError(f"{where} holds a {meta.get('model')} model but the trainer's is "
                             f"{model}; restore it with a trainer for {meta.get('model')}")
        saved = meta["arrays"]
        ours = {_name(p): x for p, x in zip(paths, target)}
        problems = []
        for name, x in ours.items():
            s = saved.get(name)
            if s is None:
                problems.append(f"the model has {name} {tuple(x.shape)} but the checkpoint "
                                "does not")
            elif tuple(s["shape"]) != tuple(x.shape):
                problems.append(f"checkpoint has {name} of shape {tuple(s['shape'])} but the "
                                f"model has {tuple(x.shape)}")
            elif s["dtype"] != np.dtype(x.dtype).name:
                problems.append(f"checkpoint has {name} as {s['dtype']} but the model has "
                                f"{np.dtype(x.dtype).name}")
        problems += [f"checkpoint has {n} {tuple(saved[n]['shape'])} but the model does not"
                     for n in saved if n not in ours]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            params = any(" params." in p for p in problems)
            hint = "a different model or config" if params else "a different optimizer"
            raise ValueError(f"{where} does not fit this trainer ({hint}?): "
                             + "; ".join(problems[:5]) + more)


def _first_line(e: Exception) -> str:
    line = (str(e).strip().splitlines() or [""])[0]
    return line.split(" See full TensorStore details")[0][:200]


def _rng(meta: dict | None):
    if meta is None:
        return None
    data = jnp.asarray(np.asarray(meta["data"], np.uint32))
    return jax.random.wrap_key_data(data, impl=meta["impl"]) if meta["typed"] else data


def jsonable(x: Any) -> Any:
    """``x`` with numpy/JAX scalars and arrays turned into plain Python for JSON."""
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic | np.ndarray | jax.Array):
        return np.asarray(x).tolist()
    return str(x)
