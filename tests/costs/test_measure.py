"""asynclane_jax.costs.measure: the measured "cpu" chip builds each call as the decode
makes it and times it once per shape."""

from __future__ import annotations

import pytest

from asynclane_jax.costs import decode_time, tokens_per_s
from asynclane_jax.costs import measure as measure_lib
from asynclane_jax.costs.measure import MeasuredCosts, call_arrays
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import init_model, preset

CFG = preset("tiny-llada-test")
T = 64


@pytest.mark.parametrize("shape, key_len, logits", [
    (CallShape("full", 2, T, T, 8, False, T), None, 8),   # vanilla: no cache
    (CallShape("full", 2, T, T, 8, True, T), None, 8),    # a cache's full refresh
    (CallShape("full", 2, 32, 32, 8, True, T), 32, 8),    # the leading columns only
    (CallShape("cached", 2, 8, T, 8, True, T), None, None),  # every query's logits
    (CallShape("cached", 2, 16, 32, 4, True, T), 32, 4),  # key bound, narrow logits
])
def test_arrays_follow_the_decode(shape, key_len, logits):
    a = call_arrays(CFG, shape)
    assert a["tokens"].shape == a["positions"].shape == (2, shape.queries)
    assert a["key_len"] == key_len
    assert (a["cache"] is None) == (not shape.cache)
    if shape.cache:
        assert a["cache"].k.shape == (CFG.n_layers, 2, T, CFG.n_kv_heads, CFG.head_dim)
        assert a["write_index"].shape == (2, shape.queries)
        assert int(a["write_index"].max()) < (key_len or T)  # within what is attended
        assert a["key_mask"].shape == (2, T)
    if logits is None:
        assert a["logits_index"] is None
    else:
        assert a["logits_index"].shape == (2, logits)


def test_measured_once_per_shape(monkeypatch):
    model = init_model(CFG, 0)
    costs = MeasuredCosts(model, repeat=1)
    calls = []
    real = measure_lib.measure_call
    monkeypatch.setattr(measure_lib, "measure_call",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    cached = CallShape("cached", 1, 8, T, 8, True, T)
    full = CallShape("full", 1, T, T, 8, True, T)
    first = costs.call_time(cached)
    assert first > 0 and costs.call_time(cached) == first
    seconds = decode_time(costs, CFG, [(full, 2), (cached, 5)])
    assert calls == [cached, full]
    assert seconds == pytest.approx(2 * costs.times[full] + 5 * first)
    assert tokens_per_s(costs, CFG, [(full, 2), (cached, 5)], 40) == pytest.approx(
        40 / seconds)


def test_measure_all_times_each_new_shape_in_rounds(monkeypatch):
    model = init_model(CFG, 0)
    costs = MeasuredCosts(model, repeat=3)
    cached = CallShape("cached", 1, 8, T, 8, True, T)
    full = CallShape("full", 1, T, T, 8, True, T)
    costs.times[full] = 1.0  # already measured: kept, not timed again
    order = []
    real = measure_lib._timer

    def timer(model, shape, calls):
        run = real(model, shape, calls)
        return lambda: order.append(shape) or run()

    monkeypatch.setattr(measure_lib, "_timer", timer)
    other = CallShape("cached", 1, 16, T, 16, True, T)
    costs.measure_all([cached, full, other, cached])
    assert costs.times[full] == 1.0
    assert order == [cached, other] * 3  # one run of each shape per round
    assert costs.times[cached] > 0 and costs.times[other] > 0
