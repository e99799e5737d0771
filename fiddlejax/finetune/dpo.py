"""DPO: Direct Preference Optimization (Rafailov et al. 2023), exact on every layout.

A preference example is a prompt with a chosen and a rejected completion. Its row of the batch
holds both sequences side by side as two segments (``prompt + chosen``, then ``prompt +
rejected``: attention stays within each, positions restart), and ``loss_mask`` marks their
completions' tokens (:data:`CHOSEN` = 1, :data:`REJECTED` = 2; the prompts 0). So an example is
one row: every layout (data shards, microbatches, pipeline stages, tensor splits) keeps its two
sequences together, and the loss is per row.

The loss is the paper's, per example, averaged over the examples of the global batch::

    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

with ``pi_c``, ``pi_r`` the policy's log-probabilities of the chosen and rejected completions
(summed over their tokens; the prompt is not scored) and ``ref_c``, ``ref_r`` the reference's,
which the batch carries as the keys ``ref_chosen`` and ``ref_rejected`` (float32 ``[rows]``,
batch keys like any other: split and microbatched with their rows). They are computed before
the step, by :func:`reference` on the frozen starting model (with LoRA that is the base with
its adapters off: ``B = 0`` at the start), so the step runs the policy alone and both
sequences of an example are scored against the same reference whatever the layout. The loss
returns the pair ``(sum over examples, number of examples)``, which fiddlejax reduces exactly
over microbatches and replicas. A ``context`` split would cut a row's sums across devices:
DPO refuses it (:func:`check_layout`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fiddlejax.staged import Reported, vocab_parallel

CHOSEN, REJECTED = 1, 2  # loss_mask values of the chosen / rejected completion's tokens
REF_KEYS = ("ref_chosen", "ref_rejected")


def sequence_logps(logits: jax.Array, batch: dict, vocab_size: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """``(chosen, rejected)``, float32 ``[rows]``: each row's log-probability of its chosen
    and its rejected completion (next-token log-probabilities of ``tokens[:, 1:]`` summed over
    the targets ``loss_mask[:, 1:]`` marks, within their segment)."""
    logits = logits.astype(jnp.float32)
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -1e30)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # a one-hot contraction, not a gather: vocabulary-sharded logits stay sharded
    onehot = jax.nn.one_hot(batch["tokens"][:, 1:], logits.shape[-1], dtype=logits.dtype)
    logp = jnp.sum(logits * onehot, -1) - logz
    keep = batch["loss_mask"][:, 1:]
    seg = batch.get("segment_ids")
    if seg is not None:
        keep = jnp.where((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0), keep, 0)
    return (jnp.sum(jnp.where(keep == CHOSEN, logp, 0.0), -1),
            jnp.sum(jnp.where(keep == REJECTED, logp, 0.0), -1))


def loss(beta: float = 0.1, vocab_size: int | None = None, in_step: bool = False) -> Callable:
    """The DPO loss for ``parallelize(loss=)``: ``(outputs, batch) ->`` the pair (sum of the
    examples' losses, their count), reporting ``reward_accuracy`` (the share of examples whose
    implicit reward prefers the chosen completion) and ``reward_margin`` (the mean of
    ``(pi_c - ref_c) - (pi_r - ref_r)``). ``in_step=True`` (a model with LoRA adapters): the
    step scores the reference itself, the base with its adapters off (:class:`InStep`), and
    the batch needs no ``ref_*`` keys."""
    if not beta > 0:
        raise ValueError(f"DPO beta={beta!r} must be positive, e.g. 0.1")

    @vocab_parallel  # the one-hot log-probabilities take the head's vocabulary-split logits
    def dpo_loss(outputs, batch: dict):
        missing = [k for k in ("loss_mask", *REF_KEYS) if k not in batch]
        if missing:
            raise ValueError(f"the DPO loss needs batch keys {missing}: preference rows "
                             "(fiddlejax.data.preference) and the reference's log-probabilities "
                             "(fiddlejax.finetune.dpo.reference)")
        logits = outputs[0] if isinstance(outputs, tuple) else outputs
        chosen, rejected = sequence_logps(logits, batch, vocab_size)
        margin = (chosen - batch["ref_chosen"]) - (rejected - batch["ref_rejected"])
        # a row with no chosen target (padding) is no example
        real = jnp.any(batch["loss_mask"][:, 1:] == CHOSEN, -1)
        per = -jax.nn.log_sigmoid(beta * margin)
        count = jnp.sum(real).astype(jnp.float32)
        value = (jnp.sum(jnp.where(real, per, 0.0)), count)
        means = {"reward_accuracy": jnp.sum(real & (margin > 0)).astype(jnp.float32),
                 "reward_margin": jnp.sum(jnp.where(real, margin, 0.0))}
        return Reported(value, means=jax.lax.stop_gradient(means))

    if in_step:
        dpo_loss.reference_scores = lambda outputs, batch: sequence_logps(
            outputs[0] if isinstance(outputs, tuple) else outputs, batch, vocab_size)
    return dpo_loss


class InStep:
    """A staged model (with LoRA adapters) whose step scores DPO's reference itself: the
    frozen base with the adapters off (every ``lora_b`` zero) is the starting model, so no
    second copy exists. The message is a pair, the policy's and the reference's (under
    ``stop_gradient``); each layer runs both, so the reference goes through the same layout
    as the policy (the same shardings, pipeline stages and microbatches); before the loss its
    outputs become each row's ``ref_chosen`` / ``ref_rejected``."""

    def __init__(self, inner, scores: Callable):
        self._inner, self._scores = inner, scores

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @staticmethod
    def _base(params):
        from fiddlejax.finetune import lora

        return jax.lax.stop_gradient(lora.adapters_off(params))

    def prologue(self, params, batch, *ops):
        return (self._inner.prologue(params, batch, *ops),
                jax.lax.stop_gradient(self._inner.prologue(self._base(params), batch, *ops)))

    def layer(self, layer_params, x, *ops):
        policy, ref = x
        return (self._inner.layer(layer_params, policy, *ops),
                self._inner.layer(self._base(layer_params), jax.lax.stop_gradient(ref), *ops))

    def weighted_loss(self, params, x, batch, *ops):
        policy, ref = x
        outputs, scored = self._inner.outputs(self._base(params), jax.lax.stop_gradient(ref),
                                              batch, *ops)
        chosen, rejected = jax.lax.stop_gradient(self._scores(outputs, scored))
        batch = {**batch, REF_KEYS[0]: chosen, REF_KEYS[1]: rejected}
        return self._inner.weighted_loss(params, policy, batch, *ops)

    def epilogue(self, params, x, batch, *ops):
        total, sums = self.weighted_loss(params, x, batch, *ops)
        return total / sums.weight


def lay_out(staged, canonical):
    """DPO's step of :func:`fiddlejax.parallel.compose.lay_out`: :class:`InStep` for a loss
    made with ``in_step=True`` (refused without adapters), else ``staged`` itself."""
    from fiddlejax.finetune import lora

    scores = getattr(getattr(staged, "loss_fn", None), "reference_scores", None)
    if scores is None:
        return staged
    if not lora.has_adapters(canonical):
        raise ValueError("dpo.loss(in_step=True) scores the reference as the base with its "
                         "LoRA adapters off; this model has no adapters: add them "
                         "(plan.lora) or score the reference beforehand (dpo.reference)")
    return InStep(staged, scores)


def reference(model) -> Callable[[dict], dict]:
    """``batch -> batch`` with ``ref_chosen`` and ``ref_rejected``: ``model``'s (the frozen
    starting model's) log-probabilities of each row's completions, one jitted forward of it
    (its weights a copy the training never updates)."""
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, tokens, segment_ids, positions, loss_mask):
        m = nnx.merge(graphdef, state)
        logits = m(tokens[:, :-1], segment_ids=segment_ids[:, :-1], positions=positions[:, :-1])
        return sequence_logps(logits, {"tokens": tokens, "segment_ids": segment_ids,
                                       "loss_mask": loss_mask},
                              getattr(getattr(m, "config", None), "vocab_size", None))

    def add(batch: dict) -> dict:
        c, r = score(state, *(batch[k] for k in ("tokens", "segment_ids", "positions",
                                                  "loss_mask")))
        return {**batch, REF_KEYS[0]: jax.device_get(c), REF_KEYS[1]: jax.device_get(r)}

    return add


def check_layout(context: int) -> None:
    """DPO sums each row's log-probabilities: a ``context`` split would cut them."""
    if context > 1:
        raise ValueError(f"DPO (data.format=preference) needs each row whole on one device; "
                         f"mesh.context={context} splits rows along the sequence. Use "
                         "mesh.context=1")
