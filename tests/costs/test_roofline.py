"""asynclane_jax.costs.roofline: which bound each call meets, slices, decodes."""

from __future__ import annotations

import pytest

from asynclane_jax.costs import (
    CHIPS,
    CostError,
    call_cost,
    call_time,
    call_timing,
    decode_time,
    per_chip,
    tokens_per_s,
)
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import preset

LLADA = preset("llada-8b-instruct")
DREAM = preset("dream-7b-instruct")
CACHED_1 = CallShape("cached", 1, 32, 640, 32, True, 640)
FULL_8 = CallShape("full", 8, 2048, 2048, 32, True, 2048)


@pytest.mark.parametrize("chip", sorted(CHIPS))
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_batch_one_cached_call_reads_the_weights(chip, weights):
    """One row, 32 queries: memory-bound, and the weights are most of what it moves."""
    cost = call_cost(LLADA, CACHED_1, weights)
    timing = call_timing(chip, cost)
    assert timing.bound == "memory"
    weights_s = cost.weight_bytes / CHIPS[chip].hbm_bytes_per_s
    assert weights_s < timing.memory_s < 1.1 * weights_s
    assert timing.total == pytest.approx(timing.memory_s + CHIPS[chip].call_overhead_s)


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_a_long_full_forward_at_eight_rows_is_compute_bound(chip):
    timing = call_timing(chip, call_cost(LLADA, FULL_8))
    assert timing.bound == "compute"
    assert timing.compute_s > 2 * timing.memory_s


def test_int8_halves_the_memory_bound_time():
    bf16 = call_timing("v5e", call_cost(LLADA, CACHED_1, "bf16"))
    int8 = call_timing("v5e", call_cost(LLADA, CACHED_1, "int8"))
    assert 0.5 < int8.memory_s / bf16.memory_s < 0.56  # the cache and activations stay
    assert int8.compute_s == bf16.compute_s  # weight-only: the bfloat16 peak


@pytest.mark.parametrize("chips", [2, 4, 8])
def test_a_slice_divides(chips):
    cost = call_cost(LLADA, CACHED_1)
    one, many = call_timing("v5e", cost), call_timing("v5e", cost, chips)
    assert many.flops == pytest.approx(one.flops / chips)
    # Everything sharded divides; the norms, inputs, embedding rows and the [tokens,
    # d] activation stream stay whole on every chip.
    whole = cost.bytes_other + cost.bytes_act_full + cost.bytes_inputs
    assert many.bytes == pytest.approx((one.bytes - whole) / chips + whole)
    assert many.collective_s > 0 and one.collective_s == 0
    assert many.total < one.total
    assert call_time("v5e", cost, chips) == many.total


def test_whole_heads_keep_undivided_attention_whole():
    """Dream's 28 query heads on 8 chips: our sharding rules replicate the attention
    (asynclane_jax.sharding.rules_for); the ideal split divides it anyway."""
    cost = call_cost(DREAM, CACHED_1)
    ideal, whole = per_chip(cost, 8, "ideal"), per_chip(cost, 8, "whole")
    attention = cost.flops_qo + cost.flops_kv + cost.flops_attention
    assert whole[0] - ideal[0] == pytest.approx(attention * (1 - 1 / 8))
    assert whole[1] > ideal[1]
    # LLaDA's 32 heads divide by 8: the two policies agree.
    llada = call_cost(LLADA, CACHED_1)
    assert per_chip(llada, 8, "whole") == per_chip(llada, 8, "ideal")


def test_decode_time_sums_its_calls():
    full = CallShape("full", 1, 640, 640, 32, True, 640)
    counts = [(full, 3), (CACHED_1, 40), (CallShape("cached", 1, 160, 640, 32, True, 640), 0)]
    expected = (3 * call_time("v6e", call_cost(LLADA, full, "int8"))
                + 40 * call_time("v6e", call_cost(LLADA, CACHED_1, "int8")))
    assert decode_time("v6e", LLADA, counts, "int8") == pytest.approx(expected)
    assert tokens_per_s("v6e", LLADA, counts, 256, "int8") == pytest.approx(256 / expected)


def test_measured_costs_stand_in_for_a_chip():
    class Measured:
        def call_time(self, shape):
            return 0.5 if shape.kind == "full" else 0.01

    full = CallShape("full", 1, 640, 640, 32, True, 640)
    assert decode_time(Measured(), LLADA, [(full, 2), (CACHED_1, 10)]) == pytest.approx(1.1)


def test_bad_input():
    cost = call_cost(LLADA, CACHED_1)
    with pytest.raises(CostError, match="v5e, v6e, h200"):
        call_time("a100", cost)
    with pytest.raises(CostError, match="positive integer"):
        call_time("v5e", cost, 0)
    with pytest.raises(CostError, match="heads="):
        call_time("v5e", cost, 8, "some")
    with pytest.raises(CostError, match="bf16, int8"):
        decode_time("v5e", LLADA, [(CACHED_1, 1)], "int4")
    with pytest.raises(CostError, match="pairs"):
        decode_time("v5e", LLADA, [CACHED_1])
    with pytest.raises(CostError, match="count >= 0"):
        decode_time("v5e", LLADA, [(CACHED_1, -1)])
    with pytest.raises(CostError, match="no model call"):
        tokens_per_s("v5e", LLADA, [(CACHED_1, 0)], 10)
