"""A checkpoint's parameters alone, one leaf at a time: what an export reads.

A restore of the whole :class:`~fiddlejax.train.TrainState` holds the optimizer's moments too
(twice the parameters again for AdamW); an export needs neither them nor every parameter at
once, nor every layer of one stacked parameter at once. Each leaf is checked against the
names, shapes and dtypes recorded at save before anything is read, and against its
fingerprint after. One process reads each leaf a layer at a time from disk
(:class:`~fiddlejax.checkpoint.stored.StoredArray`); in a multi-process job Orbax's partial
restore reads each process's shards of a leaf into the trainer's
:attr:`~fiddlejax.train.Trainer.canonical_shardings` (every process takes part in the gathers).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from fiddlejax.checkpoint import manifest
from fiddlejax.checkpoint.stored import StoredArray


class Leaves:
    """``leaves(key)``: one parameter (``("blocks", "wq")``) of a checkpoint step, as a
    :class:`StoredArray` (one process) or a sharded ``jax.Array`` (several), verified.
    :meth:`check` ends every stored leaf handed out checked whole."""

    def __init__(self, leaf: Callable, stored: list[StoredArray]):
        self._leaf, self._stored = leaf, stored

    def __call__(self, key: tuple[str, ...]):
        return self._leaf(key)

    def check(self) -> None:
        for x in self._stored:
            x.check()


def param_leaves(mgr, step: int | None = None
                 ) -> tuple[int, dict[tuple[str, ...], tuple[int, ...]], Leaves]:
    """``(step, shapes, leaves)`` of checkpoint ``step`` (default: the latest) of ``mgr`` (a
    :class:`~fiddlejax.checkpoint.CheckpointManager`): our leaves' shapes by key
    (``("blocks", "wq")``), and ``leaves(key)`` giving that one parameter (:class:`Leaves`)."""
    mgr.wait()
    mgr.reload()
    step = mgr._existing_step(step)
    where = f"checkpoint step {step} in {mgr.directory}"
    meta = mgr._read_meta(step, where)
    trainer = mgr.trainer
    abstract = jax.eval_shape(trainer.state_converters()[0], trainer.abstract_state())
    paths, shapes, _ = manifest.named_leaves(abstract)
    manifest.check_compatible(where, meta, trainer.model_name, paths, shapes)
    params = {p[1:]: x for p, x in zip(paths, shapes) if p[0] == "params"}
    items = mgr.directory / str(step) / "state"
    stored: list[StoredArray] = []

    def from_disk(key: tuple[str, ...]) -> StoredArray:
        name, x = manifest.array_name(("params", *key)), params[key]
        stored.append(StoredArray(items, name, x.shape, x.dtype,
                                  meta["arrays"][name]["fingerprint"], where))
        return stored[-1]

    spaths, shardings, _ = manifest.named_leaves(trainer.canonical_shardings)
    placed = dict(zip(spaths, shardings))

    def restored(key: tuple[str, ...]) -> jax.Array:
        path, x = ("params", *key), params[key]
        target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed[key])
        try:
            tree = mgr._restore_tree(step, manifest.nest([path], [target]), partial=True)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{where} is truncated or corrupted: {manifest.array_name(path)} "
                             f"cannot be read ({manifest.io_cause(e)})") from e
        array = manifest.lookup(tree, path)
        bad = manifest.first_mismatch(meta, [path], [array])
        if bad is not None:
            raise ValueError(f"{where} is corrupted: {bad[0]} does not match the fingerprint "
                             f"recorded when it was saved ({bad[1]} != {bad[2]})")
        return array

    one = jax.process_count() == 1 and (items / "_METADATA").is_file()
    return (step, {k: tuple(x.shape) for k, x in params.items()},
            Leaves(from_disk if one else restored, stored))
