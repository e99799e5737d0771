"""Activation memory: named remat policies, Gist-style stash encodings, automatic choice."""

from fiddlejax.memory import gist, names
from fiddlejax.memory.auto import Measurement, choose_policy, default_candidates, measure
from fiddlejax.memory.policies import (
    POLICY_NAMES,
    Policy,
    offload_supported,
    policy,
    remat_layer,
    resolve,
)

__all__ = [
    "POLICY_NAMES",
    "Measurement",
    "Policy",
    "choose_policy",
    "default_candidates",
    "gist",
    "measure",
    "names",
    "offload_supported",
    "policy",
    "remat_layer",
    "resolve",
]
