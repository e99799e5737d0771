"""Layers -> pipeline chunks: counts add up, nothing is dropped, the DP is optimal."""

import itertools
import random

import pytest

from fiddlejax.pipeline.partition import balanced, chunk_costs, partition, uniform


def compositions(n: int, k: int):
    """Every way to write n as k positive parts, in order (contiguous splits of n layers)."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("method", ["uniform", "params", "cost"])
@pytest.mark.parametrize("n,k", [(1, 1), (4, 4), (6, 4), (7, 3), (16, 8), (13, 5), (9, 2)])
def test_counts_cover_every_layer_once(method, n, k):
    counts = partition(n, k, method)
    assert len(counts) == k and sum(counts) == n and min(counts) >= 1
    # Consecutive ranges from the counts cover 0..n-1 exactly once, in order.
    layers = [layer for c, start in zip(counts, itertools.accumulate([0, *counts]))
              for layer in range(start, start + c)]
    assert layers == list(range(n))


def test_uniform_uneven_puts_surplus_in_the_middle():
    assert uniform(6, 4) == [1, 2, 2, 1]
    assert uniform(7, 4) == [2, 2, 2, 1]  # middles first, then the first chunk, last chunk last
    assert uniform(10, 4) == [2, 3, 3, 2]
    assert uniform(11, 5) == [2, 2, 3, 2, 2]
    assert uniform(3, 2) == [2, 1]
    assert uniform(8, 4) == [2, 2, 2, 2]
    for n, k in [(6, 4), (7, 4), (23, 8), (9, 9)]:
        c = uniform(n, k)
        assert max(c) - min(c) <= 1


def test_equal_costs_match_uniform():
    for n, k in [(6, 4), (7, 4), (10, 4), (12, 5)]:
        assert partition(n, k, "params") == uniform(n, k)


def test_extras_move_layers_off_the_first_and_last_chunks():
    head_heavy = partition(8, 4, "cost", last_extra=3.0)
    assert head_heavy[-1] == 1  # 1 layer + the head's 3 = 4, the best possible maximum
    assert max(chunk_costs(head_heavy, [1.0] * 8, last_extra=3.0)) == 4.0
    counts = partition(8, 4, "cost", first_extra=2.0, last_extra=2.0)
    assert counts[0] < counts[1] and counts[-1] < counts[-2]
    assert partition(4, 2, "params", layer_costs=[5, 1, 1, 1]) == [1, 3]


@pytest.mark.parametrize("seed", range(40))
def test_dp_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0.0, 0.5, 1.0, 2.0, 3.0, rng.uniform(0, 5)]) for _ in range(n)]
    first = rng.choice([0.0, 1.5, rng.uniform(0, 6)])
    last = rng.choice([0.0, 4.0, rng.uniform(0, 6)])
    got = balanced(costs, k, first_extra=first, last_extra=last)
    assert len(got) == k and sum(got) == n and min(got) >= 1

    def worst(c):
        return max(chunk_costs(c, costs, first_extra=first, last_extra=last))

    best = min(worst(c) for c in compositions(n, k))
    assert worst(got) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_clear_errors():
    with pytest.raises(ValueError, match=r"n_layers=3 is fewer than stages x virtual_stages = 4; "
                                         r"use at most 3 chunks or more layers"):
        partition(3, 4)
    with pytest.raises(ValueError, match="method='fastest' must be one of"):
        partition(4, 2, "fastest")
    with pytest.raises(ValueError, match="layer_costs has 3 entries but num_layers=4"):
        partition(4, 2, "cost", layer_costs=[1, 1, 1])
    with pytest.raises(ValueError, match=r"layer_costs\[1\]=-1.0 must be a finite cost >= 0"):
        partition(3, 2, "cost", layer_costs=[1, -1, 1])
    with pytest.raises(ValueError, match="num_chunks=0 must be a positive int"):
        partition(3, 0)
