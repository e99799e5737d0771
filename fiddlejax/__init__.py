"""fiddlejax: pipeline, tensor and data parallel training for Flax NNX models on JAX.

Attributes load lazily, so pure-Python parts (``fiddlejax.pipeline.schedules``) import
without JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "make_mesh": "fiddlejax.mesh",
    "Plan": "fiddlejax.plan",
    "Trainer": "fiddlejax.train",
    "TrainState": "fiddlejax.state",
    "parallelize": "fiddlejax.train",
    "mean_loss": "fiddlejax.staged",
    "next_token": "fiddlejax.staged",
    "Reported": "fiddlejax.staged",
    "split_model": "fiddlejax.adaptation.split",
    "CheckpointManager": "fiddlejax.checkpoint",
    "stale_correction": "fiddlejax.pipeline.staleness",
}
_MODULES = {
    "schedules": "fiddlejax.pipeline.schedules",
    "collectives": "fiddlejax.collectives",
    "memory": "fiddlejax.memory",
    "data": "fiddlejax.data",
    "distributed": "fiddlejax.distributed",
    "planner": "fiddlejax.planner",
    "sharding": "fiddlejax.sharding",
    "staged": "fiddlejax.staged",
}
__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'fiddlejax' has no attribute {name!r}")


def __dir__():
    return __all__
