"""The planner's fp8 matmuls (``Layout(matmul_dtype="fp8")``, fiddlejax/planner/fp8.py), checked
by hand: which FLOPs move to the fp8 peak, what the per-tensor quantization costs, the working
set's fp8 copies, the refusals, the CLI, and the Llama 3.2 1B prediction the docs compare with
the H200 measurement. Pure Python (no JAX)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fiddlejax import planner
from fiddlejax.planner import command

BF16, FP8 = 989e12 * 0.75, 1979e12 * 0.75  # H100 peaks x gemm_efficiency
HBM = 3.35e12 * 0.9  # H100 HBM x hbm_efficiency


def _pair(model, clus, **kw):
    base = dict(microbatch_size=1, global_batch=1, precision="bf16-mixed") | kw
    return [planner.predict(model, clus, planner.Layout(matmul_dtype=d, **base))
            for d in (None, "fp8")]


def test_tiny_llama_fp8_over_bf16_by_hand():
    """Llama h=64, 4 heads (2 KV, head 16), ffn 128, seq 32, vocab 256, one layer, one H100.
    Dense weights 2hq + 2hk + 3hf = 8192 + 4096 + 24576 = 36864; their forward FLOPs 2s x that;
    attention 4s^2 q; head 2shV. Elementwise: 51584 residual elements (1288 split + 324 whole
    per token) written and read in bf16. Optimizer: 69824 parameters x 24 bytes. fp8 adds the
    quantization, 5 bytes per element: forward the weights and the inputs (attention output
    q + SwiGLU f split, two normed inputs 2h whole, per token), backward the output gradients
    (q + 2k + 2f split, 2h whole). At this size the quantization outweighs the faster GEMMs."""
    m = planner.llama(1, 64, 4, 2, 128, 32, 256)
    bf, f8 = _pair(m, planner.cluster("h100", gpus_per_node=1), attention="xla")
    dense, attn, head = 2 * 32 * 36864, 4 * 32 * 32 * 64, 2 * 32 * 64 * 256
    ew, opt = 51584 * 2 * 2 / HBM, 69824 * 24 / HBM
    want_bf = 3 * ((dense + attn) / BF16 + ew + head / BF16) + opt
    quant = (36864 + 32 * (64 + 128) + 32 * 128) * 5 / HBM + (32 * (64 + 64 + 256) + 32 * 128) \
        * 5 / HBM
    want_f8 = 3 * (attn / BF16 + dense / FP8 + ew + head / BF16) + quant + opt
    assert bf.time.total == pytest.approx(want_bf, rel=1e-12)
    assert f8.time.total == pytest.approx(want_f8, rel=1e-12)
    assert f8.time.total / bf.time.total == pytest.approx(1.1295333, rel=1e-6)
    # one layer's fp8 weights and quantized inputs, a byte each, in the working set
    assert f8.memory.working - bf.memory.working == 36864 + 32 * (64 + 128) + 32 * 128


def test_llama_3_2_1b_on_h200_as_the_docs_compare():
    """benchmarks/results/mfu.md's config (batch 4 x 2048, one H200), measured 0.1340 s bf16
    and 0.1221 s fp8 (0.911x; cuBLAS 0.867x). With cuDNN's fused attention, as the GPU ran it
    (``auto``): 0.1175 and 0.0921 s (0.784x), 39.6 GiB. With XLA's score-writing attention
    (the planner before it modelled the fused kernel): 0.2122 and 0.1868 s (0.880x), 151.5
    GiB, more than the 141 GB the step ran on: docs/planner.md."""
    m = planner.llama(16, 2048, 32, 8, 8192, 2048, 128256, tied=True)
    h200 = planner.cluster("h200", gpus_per_node=1)
    bf, f8 = _pair(m, h200, microbatch_size=4, global_batch=4)
    assert bf.to_dict()["attention"] == "fused"
    assert bf.time.total == pytest.approx(0.1175, abs=5e-5)
    assert f8.time.total == pytest.approx(0.0921, abs=5e-5)
    assert bf.memory.total / 2**30 == pytest.approx(39.57, abs=5e-3) and bf.fits
    xbf, xf8 = _pair(m, h200, microbatch_size=4, global_batch=4, attention="xla")
    assert xbf.time.total == pytest.approx(0.2122, abs=5e-5)
    assert xf8.time.total == pytest.approx(0.1868, abs=5e-5)
    assert xf8.time.total / xbf.time.total == pytest.approx(0.880, abs=5e-4)
    assert xbf.memory.total / 2**30 == pytest.approx(151.54, abs=5e-3) and not xbf.fits


def test_dense_matmuls_of_each_family():
    """fp8 converts the weight x activation dots: GPT's and Llama's layer FLOPs minus
    attention's; a MoE layer's experts only with capacity dispatch, never its router."""
    g = planner.gpt(2, 64, 4, 32, 256)
    assert g.dense.flops == g.layer_flops - 4 * 32 * 32 * 64 == 2 * 32 * 12 * 64 * 64
    h, s, f, e, k = 64, 32, 96, 4, 2
    attn = 2 * h * h + 2 * h * 32  # q, o; k, v (2 KV heads of 16)
    drop = planner.moe_llama(1, h, 4, 2, s, 256, experts=e, top_k=k, expert_ffn=f)
    cap = planner.moe_llama(1, h, 4, 2, s, 256, experts=e, top_k=k, expert_ffn=f,
                            capacity_factor=1.5)
    assert drop.dense.flops == 2 * s * attn and drop.dense.expert_weights == 0
    assert cap.dense.flops == 2 * s * attn + 1.5 * 2 * s * 3 * h * f * k
    assert cap.dense.expert_weights == 3 * h * f * e


def test_fp8_refused_by_name_before_pricing(capsys):
    m = planner.llama(1, 64, 4, 2, 128, 32, 256)
    lo = planner.Layout(global_batch=8, data=8, precision="bf16-mixed", matmul_dtype="fp8")
    with pytest.raises(ValueError, match=r"a100-80gb \(A100-SXM4-80GB\).*no fp8.*'h100', "
                                         r"'h200'"):
        planner.predict(m, planner.cluster("a100-80gb"), lo)
    with pytest.raises(ValueError, match="no fp8 tensor cores"):
        planner.search(m, planner.cluster("a100-80gb"), 8, precision="bf16-mixed",
                       matmul_dtype="fp8")
    h100 = planner.cluster("h100")
    with pytest.raises(ValueError, match="precision='fp32'.*use precision='bf16-mixed'"):
        planner.predict(m, h100, dataclasses.replace(lo, precision="fp32"))
    with pytest.raises(ValueError, match="matmul_dtype='fp16' must be None"):
        planner.predict(m, h100, dataclasses.replace(lo, matmul_dtype="fp16"))
    with pytest.raises(ValueError, match="which of measured's FLOPs are dense"):
        planner.predict(dataclasses.replace(m, dense=None, name="measured"), h100, lo)
    code = command.plan_command(["predict", "--model", "llama3-8b", "--cluster", "a100-80gb",
                                 "--global-batch", "8", "--matmul-dtype", "fp8"])
    assert code == 2 and "no fp8 tensor cores" in capsys.readouterr().err


def test_cli_predict_and_search_say_fp8(capsys):
    flags = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
             "--kv-heads", "2", "--ffn", "128", "--seq", "32", "--vocab", "256", "--cluster",
             "h100", "--global-batch", "8", "--matmul-dtype", "fp8"]
    assert command.plan_command(["predict", *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["matmul_dtype"] == "fp8" and out["layout"]["precision"] == "bf16-mixed"
    assert command.plan_command(["predict", *flags]) == 0
    text = capsys.readouterr().out
    assert "remat=none fp8" in text and "matmuls=fp8" in text
    assert command.plan_command(["search", *flags, "--top", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]["layout"]
    assert best["matmul_dtype"] == "fp8"
