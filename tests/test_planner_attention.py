"""The planner's attention kernels (``Layout.attention``, fiddlejax/planner/attention.py): cuDNN's
fused attention keeps no s x s scores (memory and elementwise traffic), XLA's keeps them as the
model's own tables say; ``auto`` picks fused for bf16-mixed on a GPU. Checked by hand on a tiny
Llama. Pure Python (no JAX)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fiddlejax import planner
from fiddlejax.planner import attention, command

HBM = 3.35e12 * 0.9  # H100 HBM x hbm_efficiency


def _both(model, clus, **kw):
    base = dict(microbatch_size=1, global_batch=1, precision="bf16-mixed") | kw
    return [planner.predict(model, clus, planner.Layout(attention=a, **base))
            for a in ("xla", "fused")]


def test_tiny_llama_fused_over_xla_by_hand():
    """Llama h=64, 4 heads (2 KV, head 16), ffn 128, seq 32, vocab 256, one layer, one H100,
    bf16. Per token XLA keeps 4as + 2a split elements of attention (masked scores, exp,
    probabilities: 4 x 4 x 32, two statistics: 8), the fused kernel its output (a x dh = 64)
    and a float32 log-sum-exp (a = 4): 452 fewer per token, 14464 per sample. Time: each is
    written and read in bf16 once forward and twice backward. Memory: the stash loses them
    (3as^2 = 12288 float32 among them, the log-sum-exp's 128 float32 added), and the layer's
    working set the same, less the fused backward's float32 dQ accumulator (4 x 64 x 32)."""
    m = planner.llama(1, 64, 4, 2, 128, 32, 256)
    xla, fused = _both(m, planner.cluster("h100", gpus_per_node=1))
    fewer = (4 * 4 * 32 + 2 * 4 - 64 - 4) * 32
    assert fewer == 14464
    assert xla.time.total - fused.time.total == pytest.approx(3 * fewer * 2 * 2 / HBM,
                                                               rel=1e-9)
    xla_bytes = (51584 - 12288) * 2 + 12288 * 4  # 51584 elements: tests/test_planner_fp8.py
    fused_bytes = (51584 - fewer - 128) * 2 + 128 * 4
    assert xla.memory.activations - fused.memory.activations == xla_bytes - fused_bytes == 53248
    assert xla.memory.working - fused.memory.working == 53248 - 4 * 64 * 32
    for part in ("params", "grads", "optimizer"):
        assert getattr(xla.memory, part) == getattr(fused.memory, part)
    assert xla.time.compute > fused.time.compute  # FLOPs unchanged: only the traffic differs
    assert xla.model.layer_flops == fused.model.layer_flops


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_fused_state_grows_linearly_with_seq(remat):
    """Fused: a layer's kept elements per token do not depend on seq (no s x s term), so the
    stash doubles with seq; XLA's per-token count grows with seq."""
    per_token = {}
    for kind in ("fused", "xla"):
        for s in (512, 1024, 2048):
            m = planner.llama(2, 256, 8, 4, 512, s, 1000)
            lo = planner.Layout(global_batch=1, precision="bf16-mixed", remat=remat,
                                attention=kind)
            run = attention.as_run(m, lo)
            per_token[kind, s] = run.act_elems(remat, 1) / s
    assert per_token["fused", 512] == per_token["fused", 1024] == per_token["fused", 2048]
    assert per_token["xla", 512] < per_token["xla", 1024] < per_token["xla", 2048]
    mem = {s: planner.memory(planner.llama(2, 256, 8, 4, 512, s, 1000), planner.Layout(
        global_batch=1, precision="bf16-mixed", remat=remat, attention="fused")).activations
        for s in (1024, 2048)}
    assert mem[2048] == pytest.approx(2 * mem[1024], rel=1e-12)


def test_fused_tables_by_policy():
    """Without remat: scores and statistics out, output and log-sum-exp in; dots: the one
    saved score matrix out (the fused call is not a dot); other policies keep no scores.
    GPT's pipeline stash already holds the attention output: only the log-sum-exp is added."""
    h, a, s, f = 64, 4, 32, 256
    g = planner.gpt(2, h, a, s, 512)
    fg = attention.fused(g)
    assert fg.act["none"][0] == g.act["none"][0] - (4 * a * s + 2 * a - h - a) * s
    assert fg.act["dots"][0] == g.act["dots"][0] - a * s * s
    for pol in ("full", "minimal", "dots_no_batch"):
        assert fg.act[pol] == g.act[pol]
    assert fg.act_f32 == {"none": a * s, "dots": 0.0}
    assert fg.act_stashed[0] == g.act_stashed[0] - (4 * a * s + 2 * a - a) * s
    assert fg.act_none_full == sum(fg.act["none"])
    assert g.layer_flops == fg.layer_flops and g.act["none"][1] == fg.act["none"][1]
    assert f == 4 * h  # GPT's MLP width: the counts above do not involve it


def test_auto_is_fused_only_for_bf16_on_a_gpu_and_xla_is_today():
    m = planner.preset("llama3-8b", seq=2048)
    h100, cpu = planner.cluster("h100"), planner.cluster("cpu-sim")
    base = dict(data=8, global_batch=8)
    bf16 = planner.Layout(precision="bf16-mixed", **base)
    assert attention.kind(m, bf16, h100) == "fused" and attention.kind(m, bf16) == "fused"
    assert attention.kind(m, bf16, cpu) == "xla"
    assert attention.kind(m, dataclasses.replace(bf16, precision="fp32"), h100) == "xla"
    assert attention.as_run(m, dataclasses.replace(bf16, attention="xla")) is m  # unchanged
    for clus, lo in ((h100, dataclasses.replace(bf16, precision="fp32")), (cpu, bf16)):
        auto, xla = (planner.predict(m, clus, dataclasses.replace(lo, attention=x))
                     for x in ("auto", "xla"))
        assert auto.time == xla.time and auto.memory == xla.memory
    # a model that does not say its heads (from_flax of a Llama) stays XLA's
    anon = dataclasses.replace(m, heads=None)
    assert attention.kind(anon, bf16, h100) == "xla"


def test_context_parallel_keeps_the_ring_model():
    m = planner.preset("llama3-8b", seq=32768)
    lo = planner.Layout(tensor=2, context=4, global_batch=1, precision="bf16-mixed",
                        remat="full")
    h100 = planner.cluster("h100")
    preds = [planner.predict(m, h100, dataclasses.replace(lo, attention=a))
             for a in ("auto", "fused", "xla")]
    assert attention.kind(m, lo, h100) == "ring"
    assert preds[0].time == preds[2].time  # fiddlejax's ring: its own tiles
    assert preds[0].memory == preds[1].memory == preds[2].memory
    # attention="fused" asks for the ring's blocks in a fused kernel (Transformer Engine's
    # context parallelism): no score traffic, 4.7x less compute time at 32k tokens
    assert preds[1].time.compute < preds[0].time.compute / 4


def test_fused_refused_by_name(capsys):
    m = planner.llama(1, 64, 4, 2, 128, 32, 256)
    lo = planner.Layout(global_batch=8, data=8, precision="bf16-mixed", attention="fused")
    with pytest.raises(ValueError, match="cpu-sim .*no fused attention kernel"):
        planner.predict(m, planner.cluster("cpu-sim"), lo)
    h100 = planner.cluster("h100")
    with pytest.raises(ValueError, match="16-bit only; precision='fp32'"):
        planner.predict(m, h100, dataclasses.replace(lo, precision="fp32"))
    with pytest.raises(ValueError, match="attention='flash' must be one of"):
        planner.predict(m, h100, dataclasses.replace(lo, attention="flash"))
    with pytest.raises(ValueError, match="number of heads"):
        planner.predict(dataclasses.replace(m, heads=None), h100, lo)
    with pytest.raises(ValueError, match="16-bit only"):
        planner.search(m, h100, 8, precision="fp32", attention="fused")
    code = command.plan_command(["predict", "--model", "llama3-8b", "--cluster", "cpu-sim",
                                 "--global-batch", "8", "--precision", "bf16-mixed",
                                 "--attention", "fused"])
    assert code == 2 and "no fused attention kernel" in capsys.readouterr().err


def test_cli_says_and_takes_the_attention(capsys):
    flags = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
             "--kv-heads", "2", "--ffn", "128", "--seq", "32", "--vocab", "256", "--cluster",
             "h100", "--global-batch", "8"]
    rows = {}
    for a in ("auto", "xla", "fused"):
        assert command.plan_command(["predict", *flags, "--attention", a, "--json"]) == 0
        rows[a] = json.loads(capsys.readouterr().out)
    assert rows["auto"]["attention"] == "fused" and rows["xla"]["attention"] == "xla"
    assert rows["auto"]["step_time_s"] == rows["fused"]["step_time_s"]
    assert rows["fused"]["step_time_s"] < rows["xla"]["step_time_s"]
    assert rows["fused"]["memory"]["total"] < rows["xla"]["memory"]["total"]
    assert command.plan_command(["predict", *flags]) == 0
    assert "attention=fused" in capsys.readouterr().out
    assert command.plan_command(["search", *flags, "--attention", "xla", "--top", "1",
                                 "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert best["attention"] == "xla" and best["layout"]["attention"] == "xla"
