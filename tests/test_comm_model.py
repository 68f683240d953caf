"""comm_model: the alpha-beta model's closed forms against the rounds they price, the rounds against the sum they
must leave on every rank, nccl-tests' bus bandwidth, the fit, the buckets."""

from __future__ import annotations

import math
import random

import pytest

from gpipe_ref.comm_model import (
    ALGORITHMS,
    BUS_FACTORS,
    Link,
    Message,
    all_gather_time,
    all_reduce_rounds,
    all_reduce_time,
    bucket_all_reduces,
    bus_bandwidth,
    crossover_bytes,
    fit_link,
    hierarchical_all_reduce_time,
    rounds_time,
    run_rounds,
)

WORLDS = {"ring": range(1, 17), "tree": range(1, 17), "halving_doubling": (1, 2, 4, 8, 16, 32)}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithms_rounds_leave_the_sum_of_every_rank_on_every_rank(algorithm):
    for n in WORLDS[algorithm]:
        held = run_rounds(all_reduce_rounds(n, algorithm), n)
        everyone = frozenset(range(n))
        assert all(chunk == everyone for rank in held for chunk in rank), (algorithm, n, held)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_closed_forms_equal_the_rounds_priced_one_by_one(algorithm):
    rng = random.Random(0)
    for n in WORLDS[algorithm]:
        for _ in range(20):
            link, size = Link(rng.uniform(0, 1e-4), rng.uniform(1e-11, 1e-8)), rng.choice([0, 1, 1e3, 1e6, 3e9])
            priced = rounds_time(all_reduce_rounds(n, algorithm), n, size, link)
            assert math.isclose(all_reduce_time(link, n, size, algorithm), priced, rel_tol=1e-12, abs_tol=1e-15)


def test_round_counts_are_the_latency_terms():
    assert [len(all_reduce_rounds(n, "ring")) for n in (2, 4, 8)] == [2, 6, 14]  # 2(n-1)
    assert [len(all_reduce_rounds(n, "tree")) for n in (2, 5, 8)] == [2, 6, 6]  # 2 ceil(log2 n)
    assert [len(all_reduce_rounds(n, "halving_doubling")) for n in (2, 4, 8)] == [2, 4, 6]  # 2 log2 n


def test_a_wrong_round_is_refused_by_the_checker():
    with pytest.raises(ValueError, match="add ranks \\[0\\] twice"):
        run_rounds([[Message(0, 1, (0,), True)], [Message(1, 0, (0,), True)]], 2)
    with pytest.raises(ValueError, match="sends or receives twice"):
        run_rounds([[Message(0, 1, (0,), True), Message(2, 1, (0,), True)]], 3)


def test_halving_doubling_refuses_a_world_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two.*got 6; the nearest allowed are 4 and 8"):
        all_reduce_rounds(6, "halving_doubling")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        all_reduce_time(Link(0, 1), 4, 1.0, "butterfly")


def test_the_tree_wins_small_messages_the_ring_large_ones_and_they_cross_where_stated():
    link = Link(5e-6, 1 / 50e9)
    cross = crossover_bytes(link, 64)
    assert all_reduce_time(link, 64, cross / 10, "tree") < all_reduce_time(link, 64, cross / 10, "ring")
    assert all_reduce_time(link, 64, cross * 10, "tree") > all_reduce_time(link, 64, cross * 10, "ring")
    assert math.isclose(all_reduce_time(link, 64, cross, "tree"), all_reduce_time(link, 64, cross, "ring"))
    assert crossover_bytes(link, 64, "halving_doubling", "ring") is None  # never slower in a model without contention


def test_bus_bandwidth_is_nccl_tests_factor_times_the_algorithm_bandwidth():
    # doc/PERFORMANCE.md: a ring all-reduce of S bytes on links of B bytes/s takes S/B x 2(n-1)/n, busbw = B
    for n in (2, 4, 8):
        link = Link(0.0, 1 / 100e9)
        t = all_reduce_time(link, n, 1e9)
        assert math.isclose(bus_bandwidth("all_reduce", n, 1e9, t), 100e9)
        assert math.isclose(bus_bandwidth("all_gather", n, 1e9, all_gather_time(link, n, 1e9)), 100e9)
    assert BUS_FACTORS["broadcast"](8) == 1.0 and BUS_FACTORS["all_to_all"](4) == 0.75
    with pytest.raises(ValueError, match="collective must be one of"):
        bus_bandwidth("scatter", 2, 1, 1)


def test_the_fit_recovers_alpha_and_beta_from_exact_and_noisy_times():
    link = Link(30e-6, 1 / 2e9)
    sizes = [2 ** k for k in range(8, 25)]
    exact = fit_link(sizes, [link.time(s) for s in sizes])
    assert math.isclose(exact.alpha, link.alpha, rel_tol=1e-9) and math.isclose(exact.beta, link.beta, rel_tol=1e-9)
    rng = random.Random(1)
    noisy = fit_link(sizes, [link.time(s) * rng.uniform(0.9, 1.1) for s in sizes])
    assert abs(noisy.alpha / link.alpha - 1) < 0.2 and abs(noisy.beta / link.beta - 1) < 0.2
    through_origin = fit_link([1e6, 2e6], [1.0e-3, 2.2e-3])  # the line's intercept is below 0: no start-up cost
    assert through_origin.alpha == 0.0 and 1.0e-9 < through_origin.beta < 1.1e-9
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_link([8, 8], [1.0, 1.0])
    with pytest.raises(ValueError, match="same length"):
        fit_link([8], [1.0, 2.0])


def test_hierarchical_all_reduce_sends_one_gpu_share_between_nodes():
    inside, between = Link(0, 1 / 450e9), Link(0, 1 / 50e9)
    g, nodes, size = 8, 4, 1e9
    expected = 2 * (g - 1) / g * size / 450e9 + 2 * (nodes - 1) / nodes * (size / g) / 50e9
    assert math.isclose(hierarchical_all_reduce_time(inside, between, g, nodes, size), expected)
    assert hierarchical_all_reduce_time(inside, between, g, nodes, size) < all_reduce_time(between, g * nodes, size)


def test_buckets_go_out_in_order_one_at_a_time():
    link = Link(1.0, 1.0)  # a bucket of b bytes over 2 ranks: 2 + b
    spans = bucket_all_reduces([1, 2, 3, 10], [1, 1, 1, 1], [[0, 1], [2], [3]], link, 2)
    assert spans == [(2, 6), (6, 9), (10, 13)]  # the second waits for the first; the third for its gradient
    with pytest.raises(ValueError, match="one entry per gradient"):
        bucket_all_reduces([1], [1, 2], [[0]], link, 2)
