"""The planner against published 2024-26 H100 runs, each with its runtime's knobs
(``fiddlejax/planner/recent.py``): the errors measured when they were added, held as bounds."""

import dataclasses

import pytest

from fiddlejax import planner
from fiddlejax.planner import recent


@pytest.fixture(scope="module")
def rows():
    return {r["run"]: r for r in recent.compare()}


def test_fitted_runs_within_the_measured_errors(rows):
    """NeMo 24.12 (Megatron-Core + TE, fp8): mean 8.1%, worst gpt3-20b -29.0% (full remat:
    the planner puts dots at 72.5 GiB, just over its 72 GiB budget; its 0.42 s of hidden
    gradient traffic slows the compute beneath it); every other within 13%."""
    fitted = [r for r in rows.values() if not r["held_out"]]
    assert len(fitted) == 9
    mae = sum(abs(r["error"]) for r in fitted) / len(fitted)
    assert mae < 0.085, recent.markdown(list(rows.values()))
    assert all(abs(r["error"]) < 0.135 for r in fitted if r["run"] != "gpt3-20b")
    assert abs(rows["gpt3-20b"]["error"]) < 0.30
    assert all(r["fits"] for r in fitted)


def test_held_out_runs_within_the_measured_errors(rows):
    """NeMo AutoModel 26.02 (FSDP2, bf16): mean 10.1%, worst gpt-oss-20b +14.8% (+29.5% before
    hidden communication slowed the compute beneath it, ``GPUSpec.overlap_slowdown``: that
    effect was added after seeing these misses; its constant is a published measurement, not
    fitted to them); qwen3-30b-a3b is predicted not to fit (dense weights are not
    sharded over the expert axis in the planner), the one layout that ran and does not."""
    held = [r for r in rows.values() if r["source"] == recent.AUTOMODEL_2602]
    assert [r["run"] for r in held] == ["qwen3-30b-a3b", "gpt-oss-20b", "llama3-70b-fsdp"]
    mae = sum(abs(r["error"]) for r in held) / len(held)
    assert mae < 0.11, recent.markdown(list(rows.values()))
    assert max(abs(r["error"]) for r in held) < 0.15
    assert [r["fits"] for r in held] == [False, True, True]


def test_megatron_bridge_runs_as_predicted_once(rows):
    """Megatron-Bridge 25.11 on H100 (held out, predicted once when added): the dense runs
    within 12% (Llama-3-8B FSDP -7.4%, Llama-3-70B -5.1%, Llama-3.1-405B on 1,024 GPUs -11.0%;
    -3.6% and -8.5% before the overlap slowdown);
    the MoE runs predicted fast, GPT-OSS-120B +21.2% (and not to fit: the float32 logits of
    a 201k vocabulary in the last stage's working memory), Qwen3-30B-A3B +112.7% (no modelled
    effect separates it from AutoModel's run of the same model, predicted -6.4%)."""
    bridge = {n: r for n, r in rows.items() if r["source"] == recent.BRIDGE_2511}
    assert all(r["held_out"] for r in bridge.values())
    dense = ["llama3-8b-fsdp-fp8", "llama3-70b@bridge", "llama3.1-405b"]
    assert all(-0.12 < bridge[n]["error"] < 0 and bridge[n]["fits"] for n in dense)
    assert 0.20 < bridge["gpt-oss-120b"]["error"] < 0.22 and not bridge["gpt-oss-120b"]["fits"]
    assert 1.12 < bridge["qwen3-30b-a3b@bridge"]["error"] < 1.14
    held = [r for r in rows.values() if r["held_out"]]
    assert len(held) == 8 and len(rows) == 17


def test_attribution_ends_at_each_runs_prediction(rows):
    """The recent runs' attribution starts from fiddlejax's runtime and, with every knob of
    the run added, lands on ``plan validate``'s error; fused attention is what moved
    Llama-3-8B at CP 2 (-67.8% -> +7.9%) and dropless dispatch Qwen3-30B-A3B."""
    from fiddlejax.planner import attribution

    table = dict(attribution.recent_errors())
    assert list(table) == list(rows)
    for name, errs in table.items():
        assert errs[-1] == pytest.approx(rows[name]["error"], abs=1e-12), name
    assert table["llama3-8b"][1] < -0.6 and table["llama3-8b"][2] > 0
    assert table["qwen3-30b-a3b"][2] < -0.7 and abs(table["qwen3-30b-a3b"][3]) < 0.1


def test_runtime_knobs_move_what_they_say():
    """master="optimizer" holds bf16 weights and shards 12 bytes of state per parameter over
    data x context; dispatch="dropless" drops the static buffers' padding."""
    m = planner.preset("llama3-8b")
    lo = planner.Layout(data=4, context=2, zero=1, precision="bf16-mixed", global_batch=8,
                        remat="full")
    meg = dataclasses.replace(lo, master="optimizer")
    a, b = planner.memory(m, lo), planner.memory(m, meg)
    assert b.params == pytest.approx(a.params / 2)
    assert b.optimizer == pytest.approx(a.optimizer * 12 / 8 / 2)
    moe = planner.preset("mixtral-8x7b")
    from fiddlejax.planner import experts

    assert experts.padding(moe, 8) == 4.0 and experts.padding(moe, 8, "dropless") == 1.0
    with pytest.raises(ValueError, match="master="):
        planner.validate(dataclasses.replace(lo, master="gpu"), m)
