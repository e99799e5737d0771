"""Topologies, tree packing and the cost model (pure numpy: no compilation)."""

import itertools

import numpy as np
import pytest

from fiddlejax.collectives import cost
from fiddlejax.collectives import topology as T
from fiddlejax.collectives import trees as tr

GiB = 2**30
GB = 1e9


# ----------------------------------------------------------------------------- topologies


def test_dgx1_link_table():
    links = {}
    for a, b, n in T.DGX1_NVLINKS:
        links[frozenset((a, b))] = n
    assert len(links) == 16  # 12 cube edges + 4 face diagonals
    for g in range(8):  # every V100 uses its 6 NVLinks
        assert sum(n for pair, n in links.items() if g in pair) == 6
    assert sum(n == 2 for n in links.values()) == 8
    topo = T.dgx1_v100()
    assert topo.route_bandwidth(0, 3) == 50 * GB  # double link
    assert topo.route_bandwidth(0, 1) == 25 * GB
    assert topo.route_bandwidth(0, 5) == T.QPI_BW  # no NVLink: PCIe across the CPUs
    assert topo.route_bandwidth(0, 1) == topo.route_bandwidth(1, 0)


def test_routes_never_forward_through_gpus_and_subsets_keep_links():
    frag = T.dgx1_v100_fragment()
    assert frag.size == 6 and frag.devices == ("gpu0", "gpu1", "gpu2", "gpu4", "gpu5", "gpu6")
    for path in frag.routes.values():
        inner = [frag.links[k].dst for k in path[:-1]]
        assert not any(n.startswith("gpu") for n in inner)
    # gpu2 -> gpu4 has no NVLink: it goes up the PCIe tree and across QPI
    kinds = [frag.links[k].kind for k in frag.routes[2, 3]]
    assert "qpi" in kinds
    with pytest.raises(ValueError, match="distinct indices"):
        T.subset(T.dgx1_v100(), [0, 0])


def test_nvswitch_and_multi_node():
    h = T.dgx_h100()
    assert h.route_bandwidth(0, 7) == 450 * GB
    m = T.multi_node(2, nic_bandwidth=25 * GB)
    assert m.size == 16 and T.hierarchy_shape(m) == (2, 8)
    assert m.route_bandwidth(0, 1) == 450 * GB  # same node: NVSwitch
    assert m.route_bandwidth(0, 8) == 25 * GB  # across nodes: the NIC
    assert T.hierarchy_shape(h) is None
    with pytest.raises(ValueError, match="unknown topology preset"):
        T.preset("dgx-9000")


# ----------------------------------------------------------------------------- trees


def _brute_min_arborescence(cost_m, root):
    p = len(cost_m)
    others = [v for v in range(p) if v != root]
    best = None
    for choice in itertools.product(range(p), repeat=p - 1):
        parent = [-1] * p
        for v, u in zip(others, choice, strict=True):
            parent[v] = u
        try:
            tr.validate_tree(parent)
        except ValueError:
            continue
        c = sum(cost_m[u, v] for v, u in enumerate(parent) if u >= 0)
        best = c if best is None else min(best, c)
    return best


def test_min_arborescence_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(20):
        p = 5
        c = rng.integers(1, 20, size=(p, p)).astype(float)
        c[rng.random((p, p)) < 0.2] = np.inf
        root = trial % p
        try:
            parent = tr.min_arborescence(c, root)
        except ValueError:
            continue
        tr.validate_tree(parent)
        got = sum(c[u, v] for v, u in enumerate(parent) if u >= 0)
        assert got == pytest.approx(_brute_min_arborescence(c, root))


def test_binomial_tree_and_schedules_deliver_every_chunk():
    for p in range(2, 9):
        tree = tr.binomial_tree(p, root=p // 2)
        tr.validate_tree(tree)
        # depth of relative rank q is its number of set bits
        assert tr.tree_height(tree) == max(bin(q).count("1") for q in range(1, p))
    # Replay the pipelined schedules on numbers: reduce then broadcast gives the sum everywhere.
    rng = np.random.default_rng(1)
    trees = [tr.binomial_tree(6), (-1, 0, 1, 2, 3, 4), (3, 3, 3, -1, 3, 0)]
    k = 5
    data = rng.integers(0, 100, size=(6, len(trees), k))
    buf = data.copy()
    for step in tr.reduce_steps(trees, k):
        snapshot = buf.copy()  # messages of one step carry values from before the step
        for m in step:
            buf[m.dst, m.tree, m.chunk] += snapshot[m.src, m.tree, m.chunk]
    for step in tr.broadcast_steps(trees, k):
        snapshot = buf.copy()
        for m in step:
            buf[m.dst, m.tree, m.chunk] = snapshot[m.src, m.tree, m.chunk]
    np.testing.assert_array_equal(buf, np.broadcast_to(data.sum(0), buf.shape))


def test_split_sizes():
    assert tr.split_sizes(8, [0.5, 0.25, 0.25]) == [4, 2, 2]
    assert sum(tr.split_sizes(1001, [0.3, 0.3, 0.4])) == 1001


def test_packing_reaches_the_max_flow_bound_on_nvlink():
    frag = T.dgx1_v100_fragment()
    pk = tr.pack_trees(frag)
    assert tr.direct_only(frag)
    # Edmonds: arborescence packing reaches the min cut; 4 NVLinks into the weakest GPU.
    assert pk.bound == pytest.approx(100 * GB)
    assert pk.rate == pytest.approx(pk.bound, rel=1e-6)
    assert sum(pk.weights) == pytest.approx(1.0)
    for t in pk.trees:
        tr.validate_tree(t)
        for v, u in enumerate(t):  # NVLink edges only
            if u >= 0:
                assert len(frag.routes[u, v]) == 1
    # With PCIe routes too, switches cannot replicate: 105 of a 112 GB/s bound.
    hybrid = tr.pack_trees(frag, direct=False)
    assert hybrid.rate > pk.rate
    assert hybrid.rate >= 0.9 * hybrid.bound


# ----------------------------------------------------------------------------- cost model


def test_dgx1_fragment_packed_trees_beat_ring_and_approach_bound():
    """Blink's fragmented case: trees at most half the ring, within 10% of the max-flow bound."""
    frag = T.dgx1_v100_fragment()
    for nbytes in (256 * 2**20, GiB):
        ring = cost.predict("ring", frag, nbytes)
        trees = cost.predict("packed-trees", frag, nbytes)
        bound = tr.allreduce_bound(frag, nbytes)
        assert trees <= 0.5 * ring
        assert bound <= trees <= 1.10 * bound
    # Even a ring in the best NVLink order (what NCCL's ring search finds) is slower.
    best = T.subset(frag, cost.best_ring_order(frag))
    assert cost.predict("packed-trees", frag, GiB) <= 0.5 * cost.predict("ring", best, GiB)


def test_ring_time_is_alpha_beta_on_a_switch():
    p, bw = 8, 450 * GB
    topo = T.switch(p, bandwidth=bw, latency=0.5e-6)
    n = 2**28
    expected = 2 * (p - 1) * 1e-6 + 2 * (p - 1) / p * n / bw
    assert cost.predict("ring", topo, n) == pytest.approx(expected, rel=1e-9)
    assert cost.predict("recursive-halving-doubling", topo, n) == pytest.approx(
        2 * 3 * 1e-6 + 2 * (p - 1) / p * n / bw, rel=1e-9
    )


def test_auto_picks_tree_small_ring_family_large_hierarchical_multi_node():
    h = T.dgx_h100()
    assert cost.choose(h, 1024, candidates=["ring", "tree"]) == "tree"
    assert cost.choose(h, GiB, candidates=["ring", "tree"]) == "ring"
    m = T.multi_node(2)
    assert cost.choose(m, GiB, candidates=["ring", "hierarchical"]) == "hierarchical"
    # hierarchical: only the 1/inner share crosses the NICs
    assert cost.predict("hierarchical", m, GiB) < 0.25 * cost.predict("ring", m, GiB)


def test_predict_errors():
    with pytest.raises(ValueError, match="valid"):
        cost.predict("butterfly", T.dgx_h100(), 1024)
    with pytest.raises(ValueError, match="inner="):
        cost.predict("hierarchical", T.dgx_h100(), 1024)


# ----------------------------------------------------------------------------- HLO parsing


def test_hlo_parser_on_text():
    text = """HloModule m, num_partitions=4
  %a = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=[2,2]<=[4], to_apply=%add
  %b = bf16[4,2]{1,0} collective-permute(%y), channel_id=2, source_target_pairs={{0,1},{1,2}}
  %c = f32[16]{0} all-gather(%z), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %d = s32[2]{0} reduce-scatter(%w), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}
"""
    ops = cost.hlo_collectives(text)
    assert [o.kind for o in ops] == [
        "all-reduce", "collective-permute", "all-gather", "reduce-scatter"
    ]  # fmt: skip
    assert ops[0].groups == ((0, 1), (2, 3))
    assert ops[1].pairs == ((0, 1), (1, 2)) and ops[1].nbytes == 16
    sent = cost.bytes_sent_per_device(text)
    # all-reduce 2(g-1)/g*32, permute 16 (devices 0 and 1), all-gather 3/4*64, reduce-scatter 3*8
    assert sent[0] == 32 + 16 + 48 + 24
    assert sent[3] == 32 + 48 + 24


def test_hlo_parser_reads_tuple_all_reduces_with_index_comments():
    # XLA combines gradients into one tuple all-reduce and numbers long tuples with comments.
    elems = ", ".join(["f32[4]{0}"] * 5 + ["/*index=5*/f32[2,2]{1,0}", "f32[8]{0}"])
    text = f"""HloModule m, num_partitions=2
  %t = ({elems}) all-reduce(%a, %b), channel_id=1, replica_groups={{{{0,1}}}}, to_apply=%add
"""
    (op,) = cost.hlo_collectives(text)
    assert op.kind == "all-reduce" and op.nbytes == 4 * (5 * 4 + 4 + 8)
