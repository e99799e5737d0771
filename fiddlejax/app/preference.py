"""The job's DPO: preference data (``data.format=preference``, or detected from ``prompt``,
``chosen``, ``rejected``) trains with :func:`fiddlejax.finetune.dpo.loss` (``train.dpo_beta``), each
batch scored first by the frozen starting model (:func:`fiddlejax.finetune.dpo.reference`), or
with ``plan.lora`` in the step by the base with its adapters off
(:class:`~fiddlejax.finetune.dpo.InStep`)."""

from __future__ import annotations

import math
from typing import Any

from fiddlejax.app import config as config_lib


def wanted(cfg: dict) -> bool:
    """Whether the job's data is preference data (every component of it, or none)."""
    from fiddlejax.data import pipeline, prepare

    d = cfg["data"]
    formats = {prepare.data_format(path, d) for path, _ in pipeline.components(d)}
    if "preference" in formats and len(formats) > 1:
        raise config_lib.ConfigError(
            f"data.mixture mixes preference records with other data ({sorted(formats)}); DPO "
            "trains on preference data alone: give only preference components")
    return formats == {"preference"}


def loss(cfg: dict, model, plan) -> Any:
    """The DPO loss of ``train.dpo_beta``, the layout checked; with ``plan.lora`` the step
    scores the reference itself (the base with its adapters off, on the training layout)."""
    from fiddlejax.finetune import dpo

    beta = float(cfg["train"]["dpo_beta"])  # > 0: the config's schema checks it
    dpo.check_layout(int(dict(plan.mesh.shape).get("context", 1)))
    return dpo.loss(beta, getattr(getattr(model, "config", None), "vocab_size", None),
                    in_step=cfg["plan"].get("lora") is not None)


class _Scored:
    """An iterator of batches with the reference's log-probabilities added; its checkpoint
    state (``get_state`` / ``set_state``) is the wrapped iterator's."""

    def __init__(self, it, add):
        self._it, self._add = it, add

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self._add(next(self._it))

    def __getattr__(self, name):
        return getattr(self._it, name)


def with_reference(cfg: dict, data, plan):
    """``data`` (models.Batches) with each batch scored by the starting model: the model of
    ``model:`` (its pretrained weights, or ``init_from``'s), a second copy on the default
    device. With ``plan.lora`` nothing: the step scores the reference on its own layout."""
    import dataclasses

    if cfg["plan"].get("lora") is not None:
        return data

    from fiddlejax.app import build, runs
    from fiddlejax.finetune import dpo

    ref = build.build_model(cfg["model"], cfg["train"]["seed"], weights=True)
    _, loader = runs.init_weights(cfg, ref, plan)
    if loader is not None:  # init_from=<Hugging Face dir>: read here, on the default device
        from flax import nnx

        nnx.update(ref, loader())
    add = dpo.reference(ref)
    return dataclasses.replace(data, train=_Scored(data.train, add),
                               validation=_Scored(data.validation, add))


UNIFORM = math.log(2)  # the DPO loss at the start (policy = reference)
