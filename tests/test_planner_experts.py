"""The planner's mixtures of experts (fiddlejax/planner/experts.py), checked by hand: parameter
and FLOP counts of Mixtral-8x7B, the expert weights split over ``expert``, the all-to-all's
volume and time, and the search over expert sizes. Pure Python (no JAX)."""

from __future__ import annotations

import pytest

from fiddlejax import planner
from fiddlejax.planner import experts, footprint, timing
from fiddlejax.planner.search import candidates

H, F, E, K, L, V, S = 4096, 14336, 8, 2, 32, 32000, 4096  # Mixtral-8x7B
ATTN = 2 * H * H + 2 * H * 1024  # q and o, k and v (8 KV heads of 128)


def test_mixtral_parameters_and_flops_by_hand():
    m = planner.preset("mixtral-8x7b")
    per_layer = ATTN + 3 * H * F * E + H * E + 2 * H  # attention, experts, router, two norms
    assert m.params == L * per_layer + 2 * V * H + H == 46_702_792_704  # "46.7B"
    active = L * (ATTN + 3 * H * F * K + H * E + 2 * H) + 2 * V * H + H
    assert active == 12_879_925_248  # "12.9B active"
    assert m.moe.active_params(H) == 3 * H * F * K + H * E
    # FLOPs: the active matmuls only (2 per multiply-add), plus attention's scores and values
    assert m.layer_flops == 2 * S * (ATTN + 3 * H * F * K + H * E) + 4 * S * S * H
    # capacity dispatch computes its padded buffer: the experts' part x the factor
    cap = planner.moe_llama(L, H, 32, 8, S, V, experts=E, top_k=K, expert_ffn=F,
                            capacity_factor=1.25)
    assert cap.layer_flops - m.layer_flops == pytest.approx(0.25 * 2 * S * 3 * H * F * K)
    q = planner.preset("qwen3-30b-a3b")
    assert round(q.params / 1e9, 1) == 30.5 and q.moe.num_experts == 128 and q.moe.top_k == 8


def test_expert_weights_split_over_the_expert_axis():
    """One GPU's layer share: attention over tensor, router and norms whole, the experts over
    expert x tensor; so the parameter bytes of expert=8 drop by 7/8 of the experts'."""
    m = planner.preset("mixtral-8x7b")
    assert m.layer_share(2, 4) == ATTN / 2 + H * E + 2 * H + 3 * H * F * E / 8
    base = dict(tensor=1, pipe=2, microbatch_size=1, global_batch=16, remat="full",
                precision="bf16-mixed")
    one = footprint.memory(m, planner.Layout(data=8, **base))
    eight = footprint.memory(m, planner.Layout(data=1, expert=8, **base))
    assert one.params - eight.params == 4 * (L // 2) * 3 * H * F * E * 7 / 8
    assert footprint.stage_expert_params(m, planner.Layout(pipe=2, expert=8)) == (
        16 * 3 * H * F * E / 8)


def test_zero3_stores_dense_weights_over_data_and_expert():
    """zero=3 without a pipeline, as the runtime stores them: the dense weights over data x
    expert, the experts' (a quarter each at expert=4 already) over data; with data=1 it still
    shards, over expert alone."""
    m = planner.preset("mixtral-8x7b")
    base = dict(microbatch_size=1, global_batch=16, remat="full", precision="bf16-mixed")
    for data in (2, 1):
        lo = planner.Layout(data=data, expert=4, zero=3, **base)
        assert lo.fsdp and lo.fsdp_shards == 4 * data
        n = footprint.stage_params(m, lo)
        ex = footprint.stage_expert_params(m, lo)
        held = (n - ex) / (4 * data) + ex / data
        assert footprint.fsdp_held(m, lo, n) == pytest.approx(held)
        mem = footprint.memory(m, lo)
        assert mem.params == pytest.approx(4 * held) and mem.optimizer == pytest.approx(8 * held)


def test_alltoall_volume_and_time_by_hand():
    """Per MoE layer and device, forward: dispatch + combine, each k x tokens x h x bytes x
    (E_axis - 1) / E_axis; backward the same, and full remat sends the forward's again. The
    runtime's static buffers (tokens x min(k, E / S) rows to each device) send S min(k, E/S) / k
    times that: 4x for Mixtral on expert=8, 2x on expert=2."""
    m = planner.preset("mixtral-8x7b")
    assert experts.alltoall_bytes(m, S, 8, 2, padded=False) == 2 * K * S * H * 2 * 7 / 8
    assert experts.padding(m, 8) == 4 and experts.padding(m, 2) == 2
    assert experts.alltoall_bytes(m, S, 8, 2) == 2 * 7 * S * 1 * H * 2  # 7 peers x S x 1 row
    assert experts.alltoall_bytes(m, S, 1, 2) == 0
    # the padding rows' expert FLOPs: 3 more rows per real one on expert=8
    assert experts.padded_flops(m, 8) == 3 * 2 * S * 3 * H * F * K
    clus = planner.cluster("h100", nodes=2)
    lo = planner.Layout(tensor=1, pipe=1, data=2, expert=8, microbatch_size=1, global_batch=32,
                        remat="full", precision="bf16-mixed")
    bw, lat = clus.group_bandwidth(8, 1)
    a2a = 2 * 7 * lat + 2 * 7 * S * H * 2 / bw
    assert experts.alltoall_seconds(m, clus, lo, S, 2) == pytest.approx(a2a)
    t, _ = timing.step_time(m, clus, lo, simulate=False)
    m_ = lo.microbatches  # 32 / (2 x 8)
    assert m_ == 2 and t.tensor_comm == pytest.approx(m_ * L * 3 * a2a)  # no tensor all-reduce
    dense = planner.Layout(**{**lo.__dict__, "expert": 1, "data": 16})
    assert timing.step_time(m, clus, dense, simulate=False)[0].tensor_comm == 0


def test_search_tries_expert_sizes_that_divide_the_experts():
    tiny = planner.moe_llama(4, 256, 4, 2, 256, 1024, experts=4, top_k=2, expert_ffn=512)
    clus = planner.cluster("h100", nodes=2)
    assert {lo.expert for lo in candidates(tiny, clus, 16)} == {1, 2, 4}
    assert {lo.expert for lo in candidates(planner.preset("tiny"), clus, 16)} == {1}
    best = planner.search(tiny, clus, 16, top=1, remats=("none",), zero=(0,),
                          schedules=("1f1b",))[0]
    assert best.layout.gpus == 16 and best.layout.replicas * best.layout.microbatch_size \
        * best.layout.microbatches == 16
    with pytest.raises(ValueError, match="expert=3 does not divide the 4 experts.*\\[1, 2, 4\\]"):
        planner.validate(planner.Layout(data=1, expert=3, global_batch=3), tiny)
    with pytest.raises(ValueError, match="expert=2 splits a mixture of experts.*set expert=1"):
        planner.validate(planner.Layout(expert=2, global_batch=2), planner.preset("tiny"))
