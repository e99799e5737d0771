"""Any Flax NNX model, unmodified: ``fj.parallelize(model, opt, plan, layers=..., loss=...)``.

Three language models this project did not write, copied byte for byte into ``tests/external``
(see its README): Flax's own ``examples/lm1b_nnx`` decoder (blocks in numbered attributes, a
padding-and-causal mask passed to every block), the UMT5 encoder of jax-ml/bonsai (an
``nnx.List`` of blocks that return ``(x,)``, an additive padding mask as a side input, RNG streams
kept by rate-0 dropouts) and Flax's ``examples/gemma`` Transformer in a Gemma 3 configuration
(sliding-window local blocks alternating with global ones, stacked as units of two; blocks that
return ``(cache, x)``; positions and a mask as side inputs; a required ``cache`` passed None).
Each runs on data x tensor, a 1f1b and an interleaved pipeline with the single-device loss and
gradients; the adapter is a loss function and a name. A Gemma-style model of our own with local
and global attention blocks checks the repeating unit's warning and errors. The bundled GPT,
BERT, CNN and Llama run through the new form (``layers="blocks"``, a loss written in the test)
with the single-device loss and gradients, and through their explicit protocol (their own
``loss``) to the same loss and gradients.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close, assert_loss_and_grads, key_bias_tol

import fiddlejax as fj

EXTERNAL = Path(__file__).parent / "external"

LAYOUTS = [  # (data, pipe, tensor, schedule, microbatches, virtual stages)
    (4, 1, 2, None, 1, 1),
    (2, 2, 2, "1f1b", 4, 1),
    (2, 2, 2, "interleaved-1f1b", 4, 2),
]
# lm1b and UMT5 without the interleaved layout (CI time): Gemma 3 and nanoGPT
# (tests/test_any_model_round2.py) run interleaved as outside models.
TWO_LAYOUTS = LAYOUTS[:2]


def parallelize(model, optimizer, plan, **kw):
    return fj.parallelize(model, optimizer, plan, **kw)


def load(path: Path, name: str):
    """Import an external file under its own name (``models.py`` would shadow ours)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses need it
    spec.loader.exec_module(module)
    return module


def plan_for(layout_):
    data, pipe, tensor, schedule, m, v = layout_
    kw = {"schedule": schedule, "microbatches": m}
    if v > 1:
        kw["virtual_stages"] = v
    return fj.Plan(mesh=fj.make_mesh(data=data, pipe=pipe, tensor=tensor), **kw)


def check_exact(model, call, loss_fn, batch, layers, layout_, leaf_tol=None, **kw):
    """The trainer's loss, gradients and parameter tree equal the single-device ones (key
    biases, whose true gradient is zero, at :data:`helpers.KEY_BIAS`; ``leaf_tol``: more)."""
    trainer = parallelize(model, optax.sgd(0.1), plan_for(layout_), loss=loss_fn, layers=layers,
                          **kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # with any names it inferred

    def ref(p):
        return fj.mean_loss(loss_fn(call(nnx.merge(graphdef, p, rest, copy=True)), batch))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref))(params)
    state = trainer.init()
    loss, grads = trainer.loss_and_grads(state, batch)
    # also asserts the model's own tree
    assert_loss_and_grads((loss, grads), (ref_loss, ref_grads),
                          leaf_tol={**key_bias_tol(ref_grads), **(leaf_tol or {})})
    assert_close(trainer.params(state), params, 1e-7)
    return trainer


# -- Flax's examples/lm1b_nnx ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lm1b():
    d = EXTERNAL / "lm1b_nnx"
    if "configs" not in sys.modules:  # lm1b's `from configs import default`
        configs = types.ModuleType("configs")
        configs.default = load(d / "configs" / "default.py", "configs.default")
        sys.modules["configs"], sys.modules["configs.default"] = configs, configs.default
    lm = load(d / "models.py", "lm1b_nnx_models")
    cfg = lm.TransformerConfig(vocab_size=61, output_vocab_size=61, emb_dim=16, num_heads=2,
                               num_layers=4, qkv_dim=16, mlp_dim=32, max_len=16,
                               dropout_rate=0.0, attention_dropout_rate=0.0)
    with nnx.use_eager_sharding(False):
        model = lm.TransformerLM(cfg, rngs=nnx.Rngs(0))
    model.set_attributes(deterministic=True, decode=False)  # as lm1b's own train.py does
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 61, (16, 12)).astype(np.int32)
    inputs[:, 9:] = 0  # padding, masked by the model and the loss
    inputs[3, 4:] = 0
    return model, {"inputs": jnp.asarray(inputs)}


def lm1b_loss(logits, batch):
    """lm1b's own weighting: cross-entropy averaged over non-padding tokens."""
    targets = batch["inputs"]
    weights = (targets > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce * weights).sum(), weights.sum()


@pytest.mark.parametrize("layout_", TWO_LAYOUTS, ids=lambda t: f"{t[:3]}-{t[3]}")
def test_lm1b_unmodified(lm1b, layout_):
    model, batch = lm1b
    check_exact(model, lambda m: m(batch["inputs"]), lm1b_loss, batch,
                "decoder.encoderdecoderblock_*", layout_)


# -- jax-ml/bonsai's UMT5 encoder -----------------------------------------------------------
@pytest.fixture(scope="module")
def umt5():
    t5 = load(EXTERNAL / "bonsai_umt5" / "modeling.py", "bonsai_umt5_modeling")
    cfg = t5.ModelConfig(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=4, num_heads=2,
                         dropout_rate=0.0)
    model = t5.UMT5EncoderModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    mask = np.ones((16, 12), np.int32)
    mask[:, 9:] = 0
    mask[5, 3:] = 0
    batch = {"input_ids": jnp.asarray(rng.integers(1, 64, (16, 12)), jnp.int32),
             "attention_mask": jnp.asarray(mask),
             "target": jnp.asarray(rng.normal(size=(16, 12, 16)), jnp.float32)}
    return model, batch


def umt5_loss(hidden, batch):
    """Squared error of the encoder's states on the real tokens, token-weighted."""
    w = batch["attention_mask"].astype(jnp.float32)
    return (((hidden - batch["target"]) ** 2).sum(-1) * w).sum(), w.sum()


@pytest.mark.parametrize("layout_", TWO_LAYOUTS, ids=lambda t: f"{t[:3]}-{t[3]}")
def test_umt5_unmodified(umt5, layout_):
    model, batch = umt5
    # the second block's key kernel: 1.12e-5 on both layouts (the next worst 6e-6), float32
    # summation order over the relative-position-biased scores; float64 floor not measured
    check_exact(model, lambda m: m(batch["input_ids"], batch["attention_mask"]), umt5_loss,
                batch, "encoder.block", layout_,
                leaf_tol={"encoder/block/1/layer/0/SelfAttention/k/kernel": 2e-5})


# -- Flax's examples/gemma: Gemma 3 with local (sliding-window) and global blocks -----------
GEMMA_FILES = ("transformer", "transformer_cfg", "modules", "layers", "positional_embeddings",
               "sow_lib", "helpers", "params")


def load_flat(d: Path, names: tuple[str, ...]) -> dict:
    """Import modules that import each other by bare name (``import layers``), then take those
    names out of ``sys.modules`` again (gemma's ``helpers`` would shadow ours). ``jaxtyping``,
    which gemma imports only for the ``Array`` annotation, is stubbed when not installed."""
    stub = {} if importlib.util.find_spec("jaxtyping") else {
        "jaxtyping": types.SimpleNamespace(Array=jax.Array)}
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(d))
    sys.modules.update(stub)
    try:
        return {n: importlib.import_module(n) for n in names}
    finally:
        sys.path.remove(str(d))
        for n in (*names, *stub):
            sys.modules.pop(n, None)
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def gemma():
    g = load_flat(EXTERNAL / "flax_gemma", GEMMA_FILES)
    tcfg, kinds = g["transformer_cfg"], g["transformer_cfg"].AttentionType
    cfg = tcfg.TransformerConfig.gemma3_1b(  # Gemma 3's own config, shrunk; local, global x 4
        num_layers=8, num_embed=64, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
        num_kv_heads=1, sliding_window_size=3,
        attention_types=tcfg.make_attention_layers_types((kinds.LOCAL_SLIDING, kinds.GLOBAL), 8))
    model = g["transformer"].Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 64, (16, 11)).astype(np.int32)
    tokens[:, 9:] = 0  # padding, masked by the model and the loss
    tokens[6, 5:] = 0
    inputs, mask = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, :-1] > 0)
    batch = {"last_tokens": inputs, "targets": jnp.asarray(tokens[:, 1:]),  # no "cache": None
             "positions": g["transformer"].build_positions_from_mask(mask),  # as flax's
             "attention_mask": g["transformer"].make_causal_attn_mask(mask)}  # train.py does
    return model, batch


def gemma_loss(outputs, batch):
    """Next-token cross-entropy over the non-padding targets (the model returns (logits, cache))."""
    logits, _ = outputs
    w = (batch["targets"] > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * w).sum(), w.sum()


@pytest.mark.parametrize("layout_", LAYOUTS, ids=lambda t: f"{t[:3]}-{t[3]}")
def test_flax_gemma3_unmodified(gemma, layout_):
    model, batch = gemma
    call = lambda m: m(batch["last_tokens"], batch["positions"], None, batch["attention_mask"])  # noqa: E731
    with pytest.warns(UserWarning, match=r"attn_type.*units of 2 blocks"):
        trainer = check_exact(model, call, gemma_loss, batch, "layers", layout_)
    assert trainer.staged.unit == 2 and trainer.staged.num_layers == 4  # local + global


# -- blocks that differ in a static attribute -----------------------------------------------
class Attn(nnx.Module):
    """Causal attention over a window of ``window`` positions (None: global)."""

    def __init__(self, d: int, window: int | None, rngs: nnx.Rngs):
        self.window = window
        self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, positions):
        q, k, v = self.q(x), self.k(x), self.v(x)
        delta = positions[:, :, None] - positions[:, None, :]
        mask = delta >= 0
        if self.window is not None:
            mask &= delta < self.window
        s = jnp.where(mask, q @ k.swapaxes(1, 2) / q.shape[-1] ** 0.5, -1e30)
        return x + self.out(jax.nn.softmax(s) @ v)


class Local(nnx.Module):
    """A Gemma-style decoder: two local-attention blocks, then a global one, repeated."""

    def __init__(self, pattern=(4, 4, None), repeats=2, rngs=None):
        d = 16
        self.embed = nnx.Embed(32, d, rngs=rngs)
        self.blocks = nnx.List([Attn(d, w, rngs) for w in pattern * repeats])
        self.head = nnx.Linear(d, 32, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(x)


def _token_ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


next_token = fj.next_token(_token_ce)  # the model gets tokens[:, :-1]: declared, not implied


def test_repeating_unit_of_local_and_global_blocks():
    model = Local(rngs=nnx.Rngs(0))
    batch = {"tokens": jax.random.randint(jax.random.key(0), (8, 9), 0, 32)}
    with pytest.warns(UserWarning, match=r"window.*units of 3 blocks"):
        trainer = check_exact(model, lambda m: m(batch["tokens"][:, :-1]), next_token, batch,
                              "blocks", (2, 2, 2, "1f1b", 2, 1))
    assert trainer.staged.num_layers == 2 and trainer.staged.unit == 3


def test_required_optional_parameter_is_called_with_none():
    class Cached(Local):  # as Flax's Gemma: `cache` has no default, and training passes None
        def __call__(self, tokens, cache: dict | None):
            assert cache is None
            return super().__call__(tokens)

    staged, canonical = fj.split_model(Cached(pattern=(None,), rngs=nnx.Rngs(0)), next_token,
                                        layers="blocks")
    staged.prologue(staged.to_staged(canonical), {"tokens": jnp.zeros((2, 9), jnp.int32)})


def test_blocks_without_a_pattern_run_as_unequal_blocks():
    """No repeating unit: the blocks run as unequal ones (fiddlejax.adaptation.hetero), with a
    warning that says so (tests/test_hetero.py checks them exact)."""
    model = Local(pattern=(4, 4, None), repeats=1, rngs=nnx.Rngs(0))
    model.blocks.append(Attn(16, 8, nnx.Rngs(1)))
    with pytest.warns(UserWarning, match=r"repeat in no pattern; they run as unequal blocks"):
        staged, _ = fj.split_model(model, next_token, layers="blocks")
    assert staged.unit == 4 and staged.num_blocks == 4


# -- the bundled models through the new form and through the explicit protocol ---------------
def mlm_loss(logits, batch):
    """A user's masked-LM loss: cross-entropy on the masked positions, as (sum, weight)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["weights"]).sum(), batch["weights"].sum()


def classification(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def bundled(name):
    """A tiny bundled model, how the reference calls it, a user loss equal to the model's own
    ``loss``, and a batch of 8."""
    from fiddlejax.models.bert import BERT, BERTConfig, mlm_batch
    from fiddlejax.models.cnn import CNN, CNNConfig
    from fiddlejax.models.llama import Llama, LlamaConfig

    tokens = jax.random.randint(jax.random.key(1), (8, 9), 0, 63)
    if name == "llama":  # grouped-query attention: 4 heads, 2 key/value heads
        cfg = LlamaConfig(vocab_size=63, hidden_size=16, intermediate_size=32,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          seq_len=8)
        return Llama(cfg, rngs=nnx.Rngs(0)), lambda m: m(tokens[:, :-1]), next_token, {
            "tokens": tokens}
    if name == "bert":
        cfg = BERTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=4, d_ff=32)
        batch = {k: jnp.asarray(v) for k, v in mlm_batch(np.asarray(tokens), cfg, 0).items()}
        return BERT(cfg, rngs=nnx.Rngs(0)), lambda m: m(batch["inputs"]), mlm_loss, batch
    batch = {"images": jax.random.normal(jax.random.key(2), (8, 8, 8, 1)),
             "labels": jax.random.randint(jax.random.key(3), (8,), 0, 10)}
    return (CNN(CNNConfig(channels=8, n_layers=4), rngs=nnx.Rngs(0)),
            lambda m: m(batch["images"]), classification, batch)


@pytest.mark.parametrize("name, m", [("bert", 4), ("cnn", 2), ("llama", 4)])  # GPT: as Llama
@pytest.mark.filterwarnings("ignore:tensor=2, but no parameter of CNN")  # channels: no rule
def test_bundled_model_through_the_new_form_and_the_protocol(name, m):
    """``layers="blocks"`` names the model's ``stack``: its prologue and head with the user's loss
    match its ``__call__`` on one device, and its own ``loss`` gives the same result."""
    model, call, loss_fn, batch = bundled(name)
    layout_ = (2, 2, 2, "1f1b", m, 1)
    new = check_exact(model, call, loss_fn, batch, "blocks", layout_)
    loss, grads = new.loss_and_grads(new.init(), batch)
    explicit = parallelize(model, optax.sgd(0.1), plan_for(layout_))  # the model's own loss
    own_loss, own_grads = explicit.loss_and_grads(explicit.init(), batch)
    assert_loss_and_grads((own_loss, own_grads), (loss, grads))


# -- what cannot be split gets an error naming it and the fix --------------------------------
class Between(Local):
    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions) * 0.5  # code between blocks
        return self.head(x)


@pytest.mark.parametrize("cls, match", [
    (Between, r"changes the activation between block 0 and block 1"),
])
def test_unsplittable_forward_is_named(cls, match):
    model = cls(pattern=(None,), repeats=2, rngs=nnx.Rngs(0))
    batch = {"tokens": jnp.zeros((8, 9), jnp.int32)}
    trainer = parallelize(model, optax.sgd(0.1), plan_for((8, 1, 1, None, 1, 1)),
                          loss=next_token, layers="blocks")
    with pytest.raises(ValueError, match=match):
        trainer.loss_and_grads(trainer.init(), batch)


class Stages(Local):
    """Two stages of blocks with code between them (a norm): ``layers="stage*.blocks"``."""

    def __init__(self, rngs):
        super().__init__(pattern=(None,), repeats=1, rngs=rngs)
        self.stage0, self.stage1 = (nnx.Module(), nnx.Module())
        for s in (self.stage0, self.stage1):
            s.blocks = nnx.List([Attn(16, None, rngs), Attn(16, None, rngs)])
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for k, stage in enumerate((self.stage0, self.stage1)):
            for block in stage.blocks:
                x = block(x, positions)
            x = self.norm(x) if k == 0 else x
        return self.head(x)


def test_blocks_of_several_stages_are_found_in_order_and_code_between_is_named():
    model = Stages(nnx.Rngs(0))
    staged, _ = fj.split_model(model, next_token, layers="stage*.blocks")
    assert staged.block_keys == (("stage0", "blocks", 0), ("stage0", "blocks", 1),
                                 ("stage1", "blocks", 0), ("stage1", "blocks", 1))
    trainer = parallelize(model, optax.sgd(0.1), plan_for((8, 1, 1, None, 1, 1)),
                          loss=next_token, layers="stage*.blocks")
    with pytest.raises(ValueError, match="changes the activation between block 1 and block 2"):
        trainer.loss_and_grads(trainer.init(), {"tokens": jnp.zeros((8, 9), jnp.int32)})
    with pytest.raises(ValueError, match=r"no 'stage\*.layers'.*'stage\*.blocks'"):
        fj.split_model(model, next_token, layers="stage*.layers")


def test_missing_path_names_the_submodules():
    model = Local(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"no 'decoder'.*\['blocks', 'embed', 'head'\]"):
        fj.split_model(model, next_token, layers="decoder.blocks")


# -- silent cases turned into results, warnings or named errors -----------------------------
def test_rule_table_names_parameters_by_path():
    model = Local(rngs=nnx.Rngs(0))
    named = fj.sharding.annotate(model, {r"blocks/\d+/(q|k|v)/kernel": ("embed", "heads"),
                                         r"embed/embedding": ("vocab", "embed")})
    assert len(named) == 19 and model.blocks[2].k.kernel.get_metadata()["out_sharding"] == (
        "embed", "heads")
    with pytest.raises(ValueError, match=r"rules \['blocks/.*/wq'\] match no parameter"):
        fj.sharding.annotate(model, {"blocks/.*/wq": ("embed", "heads")})
    with pytest.raises(ValueError, match=r"names 1 axes .* shape \(16, 16\)"):
        fj.sharding.annotate(model, {"q/kernel": ("embed",)})
    # The names given stand; the rest are inferred around them (issue 50).
    inferred = fj.sharding.infer_names(model)
    assert "blocks/2/k/kernel" not in inferred and "blocks/2/out/kernel" in inferred
    assert model.blocks[2].k.kernel.get_metadata()["out_sharding"] == ("embed", "heads")
    assert fj.sharding.infer_names(model) == {}  # all named now


def test_names_that_do_not_fit_the_rank_are_named():
    model = Local(rngs=nnx.Rngs(0))
    model.blocks[0].q.kernel.set_metadata(out_sharding=("embed",))
    with pytest.raises(ValueError, match=r"blocks/0/q/kernel has shape \(16, 16\) but 1 sharding"):
        fj.split_model(model, next_token, layers="blocks")


def test_stack_without_the_layers_name_gets_it():
    from fiddlejax.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=63, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32),
                rngs=nnx.Rngs(0))
    for _, v in nnx.to_flat_state(nnx.state(model.blocks, nnx.Param)):  # as flax's scan example
        v.set_metadata(out_sharding=v.get_metadata()["out_sharding"][1:])
    with pytest.warns(UserWarning, match=r"lack the 'layers' name"):
        _, params = fj.split_model(model)
    for _, v in nnx.to_flat_state(params["blocks"]):
        assert v.get_metadata()["out_sharding"][0] == "layers"


def test_no_parameter_on_tensor_warns():
    specs = {"w": jax.sharding.PartitionSpec(None, None)}
    with pytest.warns(UserWarning, match=r"tensor=2, but no parameter of M"):
        fj.sharding.tensor_unused(specs, 2, "M")
    fj.sharding.tensor_unused({"w": jax.sharding.PartitionSpec(None, "tensor")}, 2, "M")


def test_name_based_remat_without_names_is_refused():
    from fiddlejax import checks
    from fiddlejax.memory import policies

    model = Local(pattern=(None,), repeats=2, rngs=nnx.Rngs(0))
    staged, canonical = fj.split_model(model, next_token, layers="blocks")
    params = staged.to_staged(canonical)
    layer = jax.tree.map(lambda a: a[0], params[staged.stack])
    msg = staged.prologue(params, {"tokens": jnp.zeros((2, 9), jnp.int32)})
    with pytest.raises(ValueError, match=r"remat='minimal' keeps .* tags none"):
        checks.check_remat_names(policies.resolve("minimal"), staged.layer, layer, msg, "Local")
    checks.check_remat_names(policies.resolve("full"), staged.layer, layer, msg, "Local")
