"""fiddlejax: pipeline, tensor and data parallel training for Flax NNX models on JAX."""

from fiddlejax.mesh import make_mesh
from fiddlejax.plan import Plan
from fiddlejax.train import Trainer, TrainState, parallelize

__all__ = ["make_mesh", "Plan", "Trainer", "TrainState", "parallelize"]
__version__ = "0.1.0"
