"""Checkpoints on Orbax: async, layout-portable, verified, preemption-safe, CheckFreq-paced.

``orbax.checkpoint.CheckpointManager`` (v0: v1 is still experimental in 0.12.8) gives what we
need: async saves whose blocking part is the device-to-host snapshot, atomic commits (a step
is written to ``<step>.orbax-checkpoint-tmp-*`` and renamed when complete: a crash leaves only
an ignored temporary directory), latest-N plus best-N preservation, multi-process preemption.

What is saved, per step directory:

- ``state``: the whole :class:`~fiddlejax.train.TrainState` in the *canonical* layout
  (``Trainer.to_canonical_state``: params as ``nnx.state(model, nnx.Param)`` and every
  param-shaped subtree of the optimizer state likewise), as nested dicts named by tree path
  (``params.blocks.w1``, ``opt_state.1.0.mu.blocks.w1``). Any layout (data, pipe, tensor, virtual
  stages, ZeRO) converts to and from it exactly, so a checkpoint restores onto any other layout:
  Orbax reads each array straight into shardings derived from the target trainer. Stacked
  leaves are stored a layer per chunk, so an export reads a layer at a time (:mod:`.stored`).
- ``meta``: JSON with the model name, every array's shape, dtype and a layout-independent
  fingerprint (a position-weighted sum of its bits, mod 2**32, computed on device), the plan that
  saved it, the job config, the data iterator state, the RNG key and user extras. Restore checks
  names, shapes and dtypes against the target before reading arrays, and fingerprints after, so a
  different model or a corrupted checkpoint fails with an error naming the array
  (:mod:`fiddlejax.checkpoint.manifest`).

CheckFreq (Mohan et al., FAST'21; policy :mod:`.checkfreq`, SIGTERM :mod:`.preemption`, the
job's glue :mod:`fiddlejax.app.checkpoints`): with ``every="auto"`` the manager times each
``save`` (call it every step): step time, snapshot stall, background persist and the slowdown of
steps overlapping it, and picks the smallest interval that keeps the cost under
``checkfreq_overhead`` (3.5%) with each persist done before the next snapshot;
:meth:`CheckpointManager.stats` reports the overhead incurred (clock: :mod:`.timing`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax

from fiddlejax.checkpoint import manifest, stored
from fiddlejax.checkpoint.checkfreq import CheckFreq
from fiddlejax.checkpoint.manifest import FORMAT, jsonable, named_leaves
from fiddlejax.checkpoint.preemption import Preemption
from fiddlejax.checkpoint.timing import SaveTiming

__all__ = ["FORMAT", "CheckFreq", "CheckpointManager", "NonFiniteState", "Preemption",
           "Restored", "jsonable", "named_leaves"]


class NonFiniteState(FloatingPointError):
    """:meth:`CheckpointManager.save` was given a state holding NaN or inf: it is not written."""


def _no_read_only_notice(record: logging.LogRecord) -> bool:  # Orbax logs every reader's open
    return not record.getMessage().startswith("Given directory is read only")


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
    - ``snapshot_gb``: hold at most this much of that snapshot and of its writes on the host at
      once (at least the largest array); a save then waits on its writes. None: all of it.
    - ``config``: the job config, stored as metadata (``fiddlejax train`` passes its own).
    - ``read_only``: a reader beside a running job (eval, generate, export): it never writes
      or deletes (a writer's save in progress included) and needs no lock; ``save`` refuses.

    Every process calls every method (Orbax writes each process's shards and synchronizes).
    """

    def __init__(self, directory: str | Path, trainer, *, every: int | str = 1,
                 max_to_keep: int | None = 3, best_metric: str | None = None,
                 best_mode: str = "min", keep_best: int = 1, async_save: bool = True,
                 checkfreq_overhead: float = 0.035, config: dict | None = None,
                 preemption: Preemption | None = None, read_only: bool = False,
                 snapshot_gb: float | None = None):
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
        self.best_metric, self.read_only, self.preemption = best_metric, read_only, preemption
        self.async_save = async_save and not read_only
        self.checkfreq = CheckFreq(checkfreq_overhead) if every == "auto" else None
        self.restored: Restored | None = None
        self._timing = SaveTiming(self.checkfreq)  # for CheckFreq and stats()
        self._pending: int | None = None  # step whose background write may still run
        self._last_saved: int | None = None

        policies = [cm.LatestN(n=max_to_keep)]
        best_fn = None
        if best_metric is not None:
            def best_fn(m):
                return float(m[best_metric])

            policies.append(cm.BestN(get_metric_fn=best_fn, reverse=best_mode == "min",
                                     n=keep_best, keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(  # a reader: no temporary directory cleaned
            read_only=True, create=False, save_interval_steps=0,
            enable_async_checkpointing=False) if read_only else ocp.CheckpointManagerOptions(
            best_fn=best_fn, best_mode=best_mode,
            preservation_policy=cm.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save, cleanup_tmp_directories=True,
            async_options=(ocp.AsyncOptions(post_finalization_callback=self._timing.persisted)
                           if async_save else None),
        )
        self._ocp = ocp
        logging.getLogger("absl").addFilter(_no_read_only_notice)  # added once
        # Replica-parallel writes slice every replicated shard on device first: on CPU ~200 tiny
        # dispatches (and compiles) per save, 5x the snapshot (Orbax's GPU default is off too).
        arrays = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)))
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(
                type_handler_registry=arrays,
                **stored.snapshot_limits(snapshot_gb, trainer)),
                           "meta": ocp.JsonCheckpointHandler()})

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
                return not self._timing.persisting()
            return step - self._last_saved >= k
        return bool(self.every) and step % self.every == 0

    def warm_up(self, state) -> None:
        """Compile (not run: a copy of the state) the save path, so the first save is quick."""
        lowered = self.trainer.state_converters()[0].lower(state)
        manifest.compile_summaries(named_leaves(lowered.out_info)[1], lowered)

    def save(self, step: int, state, force: bool = False, *, metrics: dict | None = None,
             data_state: Any = None, rng: jax.Array | None = None, extra: Any = None) -> bool:
        """Save ``state`` at ``step`` if due (or ``force``); returns whether it saved.

        ``data_state`` (e.g. a grain iterator's ``get_state()``), ``rng`` (a PRNG key) and
        ``extra`` (anything JSON) come back from :meth:`restore_all`. ``metrics`` rank checkpoints
        for ``best_metric``. The call blocks only for the device-to-host snapshot when async.
        """
        if self.read_only:
            raise ValueError(f"this CheckpointManager of {self.directory} was opened read_only="
                             "True (a reader); open one without it to save")
        step = int(step)
        if self.checkfreq is not None:  # time steps exactly: wait for the step to finish
            jax.block_until_ready(state.step)
        now = time.perf_counter()
        timing = self._timing
        timing.step_ended(now)
        if not (force or self.should_save(step)):
            timing.last_return = time.perf_counter()
            return False
        latest = self._mngr.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                timing.last_return = time.perf_counter()
                return False  # already saved (e.g. a forced final save after a periodic one)
            raise ValueError(f"step={step} is not after the latest checkpoint step {latest} in "
                             f"{self.directory}; steps must increase")
        self._finish_pending()  # Orbax would wait for it anyway; we also check it committed
        timing.book_persist()
        canonical = self.trainer.state_converters()[0](state)  # unconverted leaves: no copy
        paths, leaves, _ = named_leaves(canonical)
        fps, nonfinite = manifest.save_summaries(leaves)
        bad = manifest.first_nonfinite(paths, leaves, nonfinite)
        if bad is not None:  # a checkpoint must never hold a state that only produces NaN
            timing.last_return = time.perf_counter()
            raise NonFiniteState(
                f"step {step}: the state is not finite ({bad}); not saved to {self.directory}; "
                + self._last_good_text())
        meta = {"format": FORMAT, "step": step, "model": self.trainer.model_name,
                "plan": jsonable(self.trainer.plan.describe()), "config": jsonable(self.config),
                "arrays": manifest.array_records(paths, leaves, fps),
                "data_state": jsonable(data_state), "rng": manifest.rng_record(rng),
                "extra": jsonable(extra), "metrics": jsonable(metrics), "time": time.time()}
        ocp, chunks = self._ocp, stored.save_args(paths, leaves, self.trainer.staged)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(
            manifest.nest(paths, leaves), save_args=manifest.nest(paths, chunks)),
            meta=ocp.args.JsonSave(meta))
        timing.snapshot_begins()
        ranked = self.best_metric is not None and self.best_metric in (metrics or {})
        try:
            self._mngr.save(step, args=args, metrics=jsonable(metrics) if ranked else None,
                            force=True)
        except Exception as e:  # noqa: BLE001 - a synchronous write failed: one clear error
            self._check_committed(step, e)
        self._pending, self._last_saved = step, step
        end = timing.snapshot_ended(now, self.async_save)
        if not self.async_save:
            self._pending = None
            self._check_committed(step)
        timing.last_return = end
        return True

    def stats(self) -> dict:
        """Measured checkpoint costs: overhead share of wall time, interval, last phases."""
        return self._timing.stats()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._mngr.wait_until_finished()
            error = None
        except Exception as e:  # noqa: BLE001 - reported below with what it means for the user
            error = e
        self._timing.waited()  # time spent waiting here is not a training step
        self._check_committed(step, error)

    def _check_committed(self, step: int, error: Exception | None = None) -> None:
        if error is None and (self.directory / str(step)).is_dir():
            return
        self._mngr.reload()
        cause = manifest.io_cause(error) if error else "see Orbax's log"
        raise RuntimeError(f"saving checkpoint step {step} to {self.directory} failed ({cause}); "
                           f"nothing was changed: {self._last_good_text()}") from error

    def _last_good_text(self) -> str:
        """The newest committed step, as the user resumes from it (or that there is none)."""
        last = self._mngr.latest_step()
        if last is None:
            return f"no earlier checkpoint is in {self.directory}"
        return (f"the previous checkpoint (step {last}) is intact and is what a resume will "
                f"use (fiddlejax train ... resume={last}; Python: restore(step={last}))")

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
        step = self._existing_step(step)
        where = f"checkpoint step {step} in {self.directory}"
        meta = self._read_meta(step, where)
        abstract_state = self.trainer.abstract_state()
        to_canonical = self.trainer.state_converters()[0]
        paths, shapes, treedef = named_leaves(jax.eval_shape(to_canonical, abstract_state))
        # before reading any array
        manifest.check_compatible(where, meta, self.trainer.model_name, paths, shapes)
        # Read each array straight into the shardings the target's own conversion produces.
        shardings = jax.tree.leaves(to_canonical.lower(abstract_state).compile().output_shardings)
        target = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                  for a, s in zip(shapes, shardings)]
        leaves = self._read_arrays(step, where, paths, target)
        bad = manifest.first_mismatch(meta, paths, leaves)
        if bad is not None:
            name, got, want = bad
            raise ValueError(
                f"{where} is corrupted: {name} does not match the fingerprint recorded "
                f"when it was saved ({got} != {want}); {self._fallback(step)}")
        canonical = jax.tree_util.tree_unflatten(treedef, leaves)
        state = self.trainer.state_converters()[1](canonical)  # no copy of what it keeps
        self.restored = Restored(
            step=step, state=state, data_state=meta.get("data_state"),
            rng=manifest.rng_from_record(meta.get("rng")), extra=meta.get("extra"),
            metrics=meta.get("metrics"), config=meta.get("config"), plan=meta.get("plan"),
            model=meta.get("model"))
        return self.restored

    def _existing_step(self, step: int | None) -> int:
        """``step``, or the latest when None; FileNotFoundError naming what there is instead."""
        if step is None:
            step = self._mngr.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}; save one first or "
                                        "point the manager at the run's checkpoint directory")
        elif step not in self._mngr.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}; it has "
                                    f"steps {sorted(self._mngr.all_steps())}")
        return step

    def _read_meta(self, step: int, where: str) -> dict:
        """The step's ``meta`` item, checked to be ours and of this :data:`FORMAT`."""
        ocp = self._ocp
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
        except Exception as e:  # noqa: BLE001 - any read failure means the same to the user
            raise ValueError(f"{where} is unreadable: its metadata is missing or corrupted "
                             f"({manifest.io_cause(e)}); "
                             f"{self._fallback(step)}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "arrays" not in meta:
            raise ValueError(f"{where} is not a fiddlejax checkpoint of format {FORMAT} "
                             "(its meta item lacks 'format'/'arrays')")
        return meta

    def _read_arrays(self, step: int, where: str, paths, target: list) -> list:
        """The step's arrays in ``paths`` order, read straight into ``target``'s shardings."""
        try:
            arrays = self._restore_tree(step, manifest.nest(paths, target))
            return [manifest.lookup(arrays, p) for p in paths]
        except Exception as e:  # noqa: BLE001
            name = self._unreadable(step, paths, target)
            what = f"{name} cannot be read" if name else "reading its arrays failed"
            raise ValueError(f"{where} is truncated or corrupted: {what} "
                             f"({manifest.io_cause(e)}); {self._fallback(step)}") from e

    def _restore_tree(self, step: int, abstract: dict, partial: bool = False) -> dict:
        ocp = self._ocp
        restore = ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=partial)
        return self._mngr.restore(step, args=ocp.args.Composite(state=restore))["state"]

    def _unreadable(self, step: int, paths, target: list) -> str | None:
        """After a failed read: the first array that cannot be read alone (named in the error;
        the storage layer's own message names a byte range, not an array). Error path only."""
        for p, t in zip(paths, target):
            try:
                self._restore_tree(step, manifest.nest([p], [t]), partial=True)
            except Exception:  # noqa: BLE001 - this is the one
                return manifest.array_name(p)
        return None

    def _fallback(self, bad: int) -> str:
        """What to do instead of restoring the damaged step ``bad``."""
        earlier = sorted((s for s in self.all_steps() if s < bad), reverse=True)
        if not earlier:
            return f"no earlier checkpoint is left in {self.directory}; start a fresh run"
        return (f"restore an earlier step: fiddlejax train ... resume={earlier[0]} (Python: "
                f"restore(step={earlier[0]})); earlier steps: {earlier}")

