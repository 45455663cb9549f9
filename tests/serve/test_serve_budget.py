"""The server's memory budget: sizes read from text, slot buckets, the host scheduler
(`budget.plan`, pure Python: no model, no device), the default budget, and the footprint
report (`asynclane-jax serve --dry-run`) on the real 8B configs without weights."""

from __future__ import annotations

import json

import pytest

from asynclane_jax.serve import budget as bl
from asynclane_jax.serve.budget import PoolShape, PoolView, plan

GiB = 2**30


@pytest.mark.parametrize("text,n", [("8GiB", 8 * GiB), ("512MiB", 512 * 2**20),
                                    ("2.5G", 2_500_000_000), ("1000", 1000),
                                    (" 3 kb ", 3000), ("1TiB", 2**40), (4096, 4096)])
def test_sizes_are_read_with_their_unit(text, n):
    assert bl.parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "8 GiBs", "-1", "0", "1e9", "GiB", "8 parsecs", True])
def test_bad_sizes_are_refused(text):
    with pytest.raises(bl.BudgetError):
        bl.parse_bytes(text)


def test_slot_buckets_and_the_bucket_of_a_row_count():
    assert bl.slot_buckets(8) == (1, 2, 4, 8)
    assert bl.slot_buckets(1) == (1,)
    assert bl.slot_buckets(6) == (1, 2, 4, 6)
    assert [bl.bucket_for(n, (1, 2, 4, 8)) for n in range(10)] == [0, 1, 2, 4, 4, 8, 8,
                                                                   8, 8, 8]


def test_default_budget_prefers_the_device_then_the_host():
    budget, why = bl.default_budget(100 * GiB, 20 * GiB, 64 * GiB)
    assert budget == 40 * GiB and "device" in why
    budget, why = bl.default_budget(None, None, 64 * GiB)
    assert budget == 16 * GiB and "host" in why
    assert bl.default_budget(None, None, None)[0] == GiB


SHAPE = PoolShape(fixed=10, per_row=100)  # 1 row: 110 bytes, 2: 210, 4: 410, 8: 810


def view(key, live=0, waiting=0, held=0, oldest=None, last_used=0.0, shape=SHAPE):
    return PoolView(key=key, shape=shape, held=held, live=live, waiting=waiting,
                    oldest=oldest if oldest is not None or not waiting else 0,
                    last_used=last_used)


def bytes_of(decisions, views):
    return sum(v.shape.bytes(decisions[v.key].size) for v in views)


def test_a_pool_runs_at_the_smallest_bucket_that_holds_its_rows():
    buckets = (1, 2, 4, 8)
    for live, waiting, size, admit in [(0, 1, 1, 1), (1, 0, 1, 0), (1, 1, 2, 1),
                                       (2, 1, 4, 1), (3, 9, 8, 5), (5, 0, 8, 0),
                                       (2, 0, 2, 0)]:
        d = plan([view("a", live=live, waiting=waiting, held=8)], buckets, 10**9)["a"]
        assert (d.size, d.admit) == (size, admit), (live, waiting)
    # Idle, it keeps the state it holds (released only when another pool needs it).
    assert plan([view("a", held=4)], buckets, 10**9)["a"].size == 4


def test_the_budget_bounds_growth_and_never_drops_rows_in_flight():
    buckets = (1, 2, 4, 8)
    views = [view("a", live=1, waiting=7, held=1)]
    d = plan(views, buckets, 450)["a"]  # 4 rows (410) fit, 8 (810) do not
    assert (d.size, d.admit) == (4, 3)
    # Rows in flight keep their bucket even past a budget that shrank.
    d = plan([view("a", live=3, waiting=2, held=4)], buckets, 100)["a"]
    assert (d.size, d.admit) == (4, 1)


def test_idle_pools_are_released_least_recently_used_first():
    buckets = (1, 2, 4, 8)
    views = [view("old", held=2, last_used=1.0), view("new", held=2, last_used=5.0),
             view("busy", waiting=1, oldest=3)]
    out = plan(views, buckets, 450)  # 210 + 210 held; "busy" needs 110
    assert out["busy"].size == 1 and out["busy"].admit == 1
    assert out["old"].size == 0 and out["new"].size == 2
    assert bytes_of(out, views) <= 450


def test_a_pool_waiting_for_memory_is_not_starved():
    buckets = (1, 2, 4, 8)
    big = PoolShape(fixed=0, per_row=300)
    views = [view("a", live=2, waiting=5, held=2, oldest=10),
             view("b", waiting=1, oldest=4, shape=big)]
    out = plan(views, buckets, 450)  # a holds 210; b's one row (300) does not fit
    assert (out["b"].size, out["b"].admit) == (0, 0)
    assert (out["a"].size, out["a"].admit) == (2, 0)  # a admits nobody until b runs
    # Once a's rows are done, b starts before a's later requests.
    views = [view("a", live=0, waiting=5, held=2, oldest=10),
             view("b", waiting=1, oldest=4, shape=big)]
    out = plan(views, buckets, 450)
    assert (out["b"].size, out["b"].admit) == (1, 1)
    assert out["a"].admit == 1 and bytes_of(out, views) <= 450


def test_plan_keeps_every_pool_within_the_budget_over_random_states():
    import random

    rnd = random.Random(0)
    buckets = (1, 2, 4, 8)
    for _ in range(500):
        views, budget = [], rnd.randrange(200, 3000)
        for k in range(rnd.randrange(1, 5)):
            shape = PoolShape(fixed=rnd.randrange(0, 50), per_row=rnd.randrange(50, 400))
            live = rnd.randrange(0, 9)
            held = rnd.choice([b for b in (0,) + buckets if b >= live]) if live == 0 \
                else bl.bucket_for(live, buckets)
            views.append(view(k, live=live, waiting=rnd.randrange(0, 6), held=held,
                              oldest=rnd.randrange(100), last_used=rnd.random(),
                              shape=shape))
        out = plan(views, buckets, budget)
        in_flight = sum(v.shape.bytes(bl.bucket_for(v.live, buckets)) for v in views)
        for v in views:
            d = out[v.key]
            assert d.size >= bl.bucket_for(v.live, buckets)  # rows in flight stay
            assert d.size == 0 or d.size in buckets
            assert 0 <= d.admit <= min(v.waiting, d.size - v.live)
        # Growth and admissions happen within the budget (rows already in flight may
        # hold more, from before a budget shrank, but nothing is added then).
        grown = any(out[v.key].size > bl.bucket_for(v.live, buckets) for v in views)
        assert bytes_of(out, views) <= max(budget, in_flight) or not grown


def test_dry_run_sizes_the_8b_server_without_weights(capsys):
    """`serve --dry-run` on the LLaDA-8B preset: the K/V cache per slot is the model's
    arithmetic, every slot count's bytes are linear in the slots, and a budget too small
    for one row is reported (exit 1)."""
    from asynclane_jax import cli
    from asynclane_jax.models import preset

    cfg = preset("llada-8b-instruct")
    rc = cli.main(["serve", "--dry-run", "--model", "llada-8b-instruct", "--slots", "8",
                   "--max-tokens", "256", "--max-prompt", "512", "--device-memory",
                   "141GiB", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    assert [p["gen_length"] for p in out["pools"]] == [128, 128, 256, 256]
    for p in out["pools"]:
        T = p["prompt_length"] + p["gen_length"]
        assert p["kv_row_bytes"] == 2 * cfg.n_layers * T * cfg.n_kv_heads * cfg.head_dim * 2
        assert p["row_bytes"] >= p["kv_row_bytes"]
        assert {int(b): v for b, v in p["bytes_at"].items()} == {
            b: p["fixed_bytes"] + b * p["row_bytes"] for b in (1, 2, 4, 8)}
    assert out["all_full_bytes"] == sum(p["bytes_at"]["8"] for p in out["pools"])
    # bf16 weights of an 8B model, and the default budget: half what they leave free.
    assert 14 * GiB < out["weight_bytes"] < 17 * GiB
    assert out["kv_budget"] == (141 * GiB - out["weight_bytes"]) // 2
    rc = cli.main(["serve", "--dry-run", "--model", "dream-7b-instruct", "--max-tokens",
                   "512", "--kv-budget", "100MiB"])
    text = capsys.readouterr().out
    assert rc == 1 and "more than the budget" in text and "dream-7b-instruct" in text
    # A shipped model by name (its config only), int8 weights smaller than float32's.
    args = ["serve", "--dry-run", "--model", "tiny-llada", "--max-tokens", "64",
            "--max-prompt", "64", "--kv-budget", "1GiB", "--json"]
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--quantize", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert plain["kv_budget"] == GiB and plain["fits"] and plain["quantize"] == "none"
    assert int8["weight_bytes"] < plain["weight_bytes"] and int8["quantize"] == "int8"


def test_dry_run_refuses_a_bad_budget_or_model(capsys):
    from asynclane_jax import cli

    # The server itself refuses a bad budget before it loads a model.
    assert cli.main(["serve", "--kv-budget", "8 parsecs"]) == 2
    assert "--kv-budget" in capsys.readouterr().err
    assert cli.main(["serve", "--dry-run", "--model", "tiny-llada", "--kv-budget",
                     "lots"]) == 2
    assert "--kv-budget 'lots'" in capsys.readouterr().err
    assert cli.main(["serve", "--dry-run", "--model", "no-such-model-here"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_dry_run_counts_the_allowed_configurations(capsys):
    """`serve --dry-run --allow-options`: a configuration whose program differs (lanes
    off) adds its own pools, named by its options; one that only sets a traced option
    (a threshold) runs in the server's pools and adds none; more than the server takes
    is refused as the server refuses it."""
    from asynclane_jax import cli
    from asynclane_jax.serve.engine import MAX_CONFIGS

    base = ["serve", "--dry-run", "--model", "tiny-llada", "--max-tokens", "64",
            "--max-prompt", "64", "--kv-budget", "1GiB", "--json"]
    assert cli.main(base) == 0
    own = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--allow-options", "threshold=0.8"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"] == own["pools"]
    assert cli.main(base + ["--allow-options", "max_lanes=1"]) == 0
    both = json.loads(capsys.readouterr().out)
    n = len(own["pools"])
    assert both["pools"][:n] == own["pools"] and len(both["pools"]) == 2 * n
    assert all(p["config"] == {"max_lanes": 1} for p in both["pools"][n:])
    # One lane slot instead of many: a smaller state per row.
    assert all(a["row_bytes"] > b["row_bytes"] for a, b in zip(own["pools"], both["pools"][n:]))
    assert both["all_full_bytes"] == own["all_full_bytes"] + sum(
        p["bytes_at"]["8"] for p in both["pools"][n:])
    assert len(both["rows_in_budget"]) == 2 * n
    too_many = [a for k in range(MAX_CONFIGS) for a in ("--allow-options", f"max_lanes={k + 2}")]
    assert cli.main(base + too_many) == 2
    assert "at most" in capsys.readouterr().err
