"""A checkpoint's parameters alone, one leaf at a time: what an export reads.

A restore of the whole :class:`~fiddlejax.train.TrainState` holds the optimizer's moments too
(twice the parameters again for AdamW); an export needs neither them nor every parameter at
once. Orbax's partial restore reads one canonical parameter straight into the trainer's
:attr:`~fiddlejax.train.Trainer.canonical_shardings` (each process its shards), checked
against the names, shapes and dtypes recorded at save before anything is read, and against
its fingerprint after.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from fiddlejax.checkpoint import manifest


def param_leaves(mgr, step: int | None = None
                 ) -> tuple[int, dict[tuple[str, ...], tuple[int, ...]], Callable]:
    """``(step, shapes, leaf)`` of checkpoint ``step`` (default: the latest) of ``mgr`` (a
    :class:`~fiddlejax.checkpoint.CheckpointManager`): our leaves' shapes by key
    (``("blocks", "wq")``), and ``leaf(key)`` restoring that one parameter, verified."""
    mgr.wait()
    mgr.reload()
    step = mgr._existing_step(step)
    where = f"checkpoint step {step} in {mgr.directory}"
    meta = mgr._read_meta(step, where)
    trainer = mgr.trainer
    abstract = jax.eval_shape(trainer.state_converters()[0], trainer.abstract_state())
    paths, shapes, _ = manifest.named_leaves(abstract)
    manifest.check_compatible(where, meta, trainer.model_name, paths, shapes)
    spaths, shardings, _ = manifest.named_leaves(trainer.canonical_shardings)
    placed = dict(zip(spaths, shardings))
    params = {p[1:]: x for p, x in zip(paths, shapes) if p[0] == "params"}

    def leaf(key: tuple[str, ...]) -> jax.Array:
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

    return step, {k: tuple(x.shape) for k, x in params.items()}, leaf
