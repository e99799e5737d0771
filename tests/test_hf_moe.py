"""Mixtral and Qwen3-MoE through the shared decoder: router logits and the load-balancing loss
against transformers' (recorded fixtures, no torch), transformers' fused expert layout read,
the refusals, and a Mixtral trained on data=2 x pipe=2 x tensor=2 with 1F1B equal to one
device with the router losses in the loss. (Logits and the export round trip: the families'
tests in test_hf_families.py.)"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_loss_and_grads, reference_loss_and_grads, rel_err, tokens

import fiddlejax as fj
from fiddlejax import models
from fiddlejax.models.common import cross_entropy, scan_layers
from fiddlejax.models.decoder import FAMILIES, Decoder
from fiddlejax.models.hf import read_safetensors
from fiddlejax.staged import mean_loss

FIXTURES = Path(__file__).parent / "fixtures"  # made by fixtures/make_hf_families.py


def load(family, **kw):
    return models.from_pretrained(FIXTURES / f"hf_{family}", **kw)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_and_aux_loss_match_transformers(family):
    """Logits and, with ``output_router_logits=True``, transformers' per-layer ``[B * T, E]``
    router logits; the loss of one sequence is its cross-entropy plus ``router_aux_loss_coef``
    times transformers' load-balancing loss of that sequence (the per-sequence loss is
    transformers' on one sequence), reported as the ``moe_aux_loss`` metric, and
    ``router_losses`` hands the per-sequence value out."""
    ref = np.load(FIXTURES / f"hf_{family}.npz")
    model = load(family)
    batch = {"tokens": ref["tokens"][:1]}

    # The family's own feature switched off must change the logits: Mixtral's window,
    # Qwen3-MoE's gates left unnormalised.
    feature = {"mixtral": {"sliding_window": None, "layer_types": None},
               "qwen3_moe": {"norm_topk_prob": True}}[family]
    without = nnx.eval_shape(lambda: type(model)(dataclasses.replace(model.config, **feature),
                                                 rngs=nnx.Rngs(0)))
    nnx.update(without, nnx.state(model, nnx.Param))

    @nnx.jit  # one compile instead of op-by-op dispatch
    def run(model, without, tokens, batch):
        logits, router = model(tokens, output_router_logits=True)
        outputs = model.head(scan_layers(model.blocks, model.prologue(batch)))
        ce = cross_entropy(outputs[0], batch["tokens"][:, 1:], model.config.vocab_size).mean()
        return (logits, router, without(tokens), ce, model.loss(outputs, batch),
                model.router_losses(outputs, batch))

    logits, router, other, ce, loss, per_seq = run(model, without, ref["tokens"], batch)
    assert type(model).__name__ == {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}[family]
    assert len(router) == model.config.num_hidden_layers == 2
    assert rel_err(np.stack(router), ref["router_logits"]) < 1e-4  # measured 2.6e-7, 3.2e-7
    assert rel_err(logits, ref["logits"]) < 1e-4  # measured 4.9e-7, 3.1e-7
    assert ref["logits"].std() > 0.5 and rel_err(other, ref["logits"]) > 1e-3
    coef = model.config.router_aux_loss_coef
    assert coef == {"mixtral": 0.02, "qwen3_moe": 0.001}[family]  # read from config.json
    assert abs(float(per_seq.aux[0]) / float(ref["aux_loss"]) - 1) < 1e-5
    assert abs(float(mean_loss(loss)) - float(ce) - coef * float(ref["aux_loss"])) < 1e-6
    assert abs(float(loss.means["moe_aux_loss"]) / float(ref["aux_loss"]) - 1) < 1e-5  # metric
    assert float(per_seq.dropped.sum()) == 0  # dropless


def test_padding_stays_out_of_the_router_losses():
    """A packed row (segment ids) of one document then padding (segment 0): its router losses
    are the document's alone (padding masked, as transformers' attention_mask), and the loss
    pair weights them by the row's targets."""
    model = load("mixtral")
    ids = np.load(FIXTURES / "hf_mixtral.npz")["tokens"][:1, :11]
    padded = np.concatenate([ids, np.zeros((1, 5), ids.dtype)], 1)
    seg = np.array([[1] * 11 + [0] * 5], np.int32)

    @nnx.jit
    def losses(model, batch):
        outputs = model.head(scan_layers(model.blocks, model.prologue(batch)))
        return model.router_losses(outputs, batch), model.loss(outputs, batch)

    # alone: the document's 11 tokens as inputs (a 12th as the target), as the packed row has
    (alone, _), (packed, value) = losses(model, {"tokens": padded[:, :12]}), losses(
        model, {"tokens": padded, "segment_ids": seg})
    assert abs(float(packed.aux[0]) / float(alone.aux[0]) - 1) < 1e-5
    total, count = value.value
    assert float(count) == 10  # the document's targets
    assert abs(float(value.means["moe_aux_loss"]) / float(count) / float(alone.aux[0]) - 1
               ) < 1e-5


def test_fused_expert_layout_reads(tmp_path):
    """transformers' in-memory layout (``mlp.experts.gate_up_proj [E, 2f, d]``,
    ``down_proj [E, d, f]``, router ``mlp.gate``) loads as the per-expert tensors do."""
    from safetensors.numpy import save_file

    src = FIXTURES / "hf_mixtral"
    t = read_safetensors(src)
    fused = {k: v for k, v in t.items() if ".block_sparse_moe." not in k}
    for i in range(2):
        pre, e = f"model.layers.{i}.", range(4)
        moe = pre + "block_sparse_moe."
        fused[pre + "mlp.gate.weight"] = t[moe + "gate.weight"]
        fused[pre + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
            [t[f"{moe}experts.{j}.w1.weight"], t[f"{moe}experts.{j}.w3.weight"]]) for j in e])
        fused[pre + "mlp.experts.down_proj"] = np.stack([t[f"{moe}experts.{j}.w2.weight"]
                                                         for j in e])
    shutil.copy(src / "config.json", tmp_path)
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours, theirs = models.from_pretrained(tmp_path), load("mixtral")
    for a, b in zip(jax.tree.leaves(nnx.state(ours, nnx.Param)),
                    jax.tree.leaves(nnx.state(theirs, nnx.Param)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_moe_refusals_name_the_key():
    qwen = json.loads((FIXTURES / "hf_qwen3_moe" / "config.json").read_text())
    mixtral = json.loads((FIXTURES / "hf_mixtral" / "config.json").read_text())
    mistral = json.loads((FIXTURES / "hf_mistral" / "config.json").read_text())
    for hf, match in [
        ({**qwen, "mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\].*decoder_sparse_step=1"),
        ({**qwen, "decoder_sparse_step": 2}, "decoder_sparse_step=2; qwen3_moe supports only "
                                             "decoder_sparse_step=1"),
        ({**mixtral, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1; mixtral supports"),
        ({**mixtral, "num_experts": 8}, "num_local_experts=4 and num_experts=8; keep one"),
        ({**mixtral, "moe_intermediate_size": 8}, "moe_intermediate_size=8, which fiddlejax's "
                                                  "mixtral"),
        ({**mistral, "num_local_experts": 4}, "num_local_experts=4, which fiddlejax's mistral"),
        ({**mixtral, "num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
    ]:
        with pytest.raises(ValueError, match=match):
            Decoder.config_from_hf(hf)
    with pytest.raises(ValueError, match="output_router_logits=True: Mistral has no router"):
        load("mistral")(np.ones((1, 4), np.int32), output_router_logits=True)


# The Hub's config.json of Mixtral-8x7B-v0.1 and Qwen3-30B-A3B (transformers 4.36 and 4.51).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("hf,params", [(MIXTRAL_8X7B, 46_702_792_704),
                                       (QWEN3_30B_A3B, 30_532_122_624)])
def test_hub_configs_read_with_their_parameter_counts(hf, params):
    """The released models' config.json read (every key known) into the published parameter
    counts (abstract: nothing allocated)."""
    cls = FAMILIES[hf["model_type"]]
    model = nnx.eval_shape(lambda: cls(cls.config_from_hf(hf), rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == params
    assert model.config.checkpoint_dtype == "bfloat16"


def test_job_picks_the_moe_family():
    from fiddlejax.app import config

    for family in ("mixtral", "qwen3_moe"):
        cfg = config.load(None, [f"model.from_pretrained={FIXTURES / f'hf_{family}'}"])
        assert cfg["model"]["name"] == family


def test_mixtral_on_222_pipeline_matches_one_device():
    """data=2 x pipe=2 x tensor=2, 1F1B: attention heads and each expert's matrices split over
    tensor, the two layers over two stages, the router tally riding after the sliding-window
    activation; loss (router losses with large coefficients, so they matter: the loss of one
    sequence is checked against transformers' above) and gradients equal one device, float32
    rel < 1e-5."""
    base = load("mixtral", seq_len=12)
    cfg = dataclasses.replace(base.config, router_aux_loss_coef=0.5, router_z_loss_coef=0.05)
    model = nnx.eval_shape(lambda: type(base)(cfg, rngs=nnx.Rngs(0)))
    nnx.update(model, nnx.state(base, nnx.Param))
    # ids from 1: the fixture's pad row 0 is zeros (see test_hf_families' 222 test)
    batch = {"tokens": 1 + tokens(3, 8, 12, cfg.vocab_size - 1)["tokens"]}
    ref_loss, ref_grads = reference_loss_and_grads(model, batch)
    mesh = fj.make_mesh(data=2, pipe=2, tensor=2, devices=jax.devices()[:8])
    trainer = fj.parallelize(model, optax.sgd(0.1), fj.Plan(mesh=mesh, schedule="1f1b",
                                                            microbatches=2))
    state = trainer.init()
    spec = {jax.tree_util.keystr(p): v.sharding.spec
            for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    of = lambda name: next(v for k, v in spec.items() if f"'{name}'" in k)  # noqa: E731
    # Megatron inside each expert: gate and up split by columns, down by rows
    assert of("w_gate")[-1] == of("w_up")[-1] == of("w_down")[-2] == "tensor"
    loss, grads = trainer.loss_and_grads(state, batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def _optax_ce(outputs, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        outputs[0], batch["tokens"][:, 1:]).mean()


def _hand_ce(outputs, batch):  # a (sum, count) pair over the targets above 5
    targets = batch["tokens"][:, 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(outputs[0]), targets[..., None], -1)[..., 0]
    mask = targets > 5
    return jnp.sum(nll * mask), jnp.sum(mask)


@pytest.mark.parametrize("family, loss_fn", [("mixtral", _optax_ce), ("qwen3_moe", _hand_ce),
                                             ("deepseek_v3", _hand_ce), ("gpt_oss", _optax_ce)])
def test_user_cross_entropy_on_expert_data_tensor(family, loss_fn):
    """A user's own cross-entropy (``loss=``, optax's integer-label one or a hand-written
    ``take_along_axis``) on expert=2 x data=2 x tensor=2 runs (XLA's partitioner aborted the
    process on its gather over vocabulary-split logits; ``parallel.expert.loss_inputs`` hands
    the loss its rows split and the vocabulary whole) and its loss and gradients equal one
    device's, float32 rel < 1e-5."""
    model = load(family, seq_len=8)
    batch = {"tokens": 1 + tokens(5, 8, 8, model.config.vocab_size - 1)["tokens"]}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def reference(p):
        m = nnx.merge(graphdef, p, rest, copy=True)
        stack = getattr(m, m.stack)  # (DeepSeek-V3's dense layers run in the prologue)
        return mean_loss(loss_fn(m.head(scan_layers(stack, m.prologue(batch))), batch))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    plan = fj.Plan(mesh=fj.make_mesh(data=2, expert=2, tensor=2))
    trainer = fj.parallelize(model, optax.sgd(0.1), plan, loss=loss_fn)
    loss, grads = trainer.loss_and_grads(trainer.init(), batch)
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads))
