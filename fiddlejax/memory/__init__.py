"""Activation memory: named remat policies, Gist-style stash encodings, automatic choice."""

from fiddlejax.memory import gist, names
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
    "Policy",
    "gist",
    "names",
    "offload_supported",
    "policy",
    "remat_layer",
    "resolve",
]
