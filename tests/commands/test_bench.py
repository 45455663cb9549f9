"""The bench command (asynclane_jax.bench): specs, the runner's method, rows, JSON, the
command line; on the shipped tiny-llada, and on a stand-in for `generate` that records
each call (the order of the calls is the method: warm-up, then batches interleaved with
the order rotated)."""

import json
import types

import numpy as np
import pytest

import asynclane_jax
from asynclane_jax.bench import compare, report, runner
from asynclane_jax.bench.spec import default_specs, parse_spec, split_model, validate
from asynclane_jax.cli import main
from asynclane_jax.decoding import api
from asynclane_jax.decoding.registry import samplers
from asynclane_jax.errors import UsageError
from asynclane_jax.testbed import evaluate, tasks

G = 64
# A threshold no other test uses: these programs are compiled here first (compile_s > 0).
SPECS = ["fast-dllm:cache=prefix|dual:threshold=0.85",
         "fast-dllm:cache=dual:threshold=0.85:early_stop=true"]


@pytest.fixture(scope="module")
def tiny():
    return asynclane_jax.load("tiny-llada")


def _png(path):
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------- specs

def test_parse_spec_alternatives_and_defaults():
    assert parse_spec("vanilla") == ("vanilla", [{}])
    assert parse_spec("fast-dllm:cache=dual:threshold=0.8") == (
        "fast-dllm", [{"cache": "dual", "threshold": 0.8}])
    name, variants = parse_spec("localleap:early_stop=true:radius=2|4")
    assert name == "localleap"
    assert variants == [{"early_stop": True, "radius": 2, "cache": "prefix"},
                        {"early_stop": True, "radius": 2, "cache": "dual"},
                        {"early_stop": True, "radius": 4, "cache": "prefix"},
                        {"early_stop": True, "radius": 4, "cache": "dual"}]
    assert parse_spec("fast-dllm")[1] == [{"cache": "prefix"}, {"cache": "dual"}]


@pytest.mark.parametrize("spec,needle", [
    ("", "no sampler name"), ("fast-dllm:cache", "not key=value"),
    ("fast-dllm:cache=dual:cache=prefix", "given twice"), ("fast-dllm:cache=dual|", "empty"),
])
def test_parse_spec_errors(spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_spec(spec)


def test_default_specs_are_registered():
    specs = default_specs()
    assert specs and all(s.split(":")[0] in samplers() for s in specs)
    assert ("asynclane" in specs) == ("asynclane" in samplers())


def test_spec_on_another_model():
    assert split_model("d2f:skip_threshold=0.8@tiny-llada-d2f") == (
        "d2f:skip_threshold=0.8", "tiny-llada-d2f")
    assert split_model("fast-dllm") == ("fast-dllm", None)
    with pytest.raises(UsageError, match="no model name"):
        split_model("d2f@")
    # Validation sees through the model part.
    assert validate(["d2f:skip_threshold=0.8@tiny-llada-d2f"], [64])[0][1] == "d2f"


# ------------------------------------------------------------------------- bench runs

@pytest.mark.parametrize("batch", [1, 2])
def test_run_bench_rows(tiny, batch):
    model, tok, _ = tiny
    variants, seen = [], []
    rows = runner.run_bench(model, tok, SPECS, [G], 2, batch, progress=False,
                            on_length=seen.append, model_name="tiny-llada", variants=variants,
                            annotate=compare.add_speedups)
    assert len(seen) == 1 and seen[0] == rows
    assert [r["sampler"] for r in rows] == SPECS
    for r in rows:
        assert set(r) == set(runner.ROW_KEYS)
        assert (r["model"], r["gen_length"], r["n"], r["batch"]) == ("tiny-llada", G, 2, batch)
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["tps"] > 0 and r["wall_s"] > 0 and r["compile_s"] > 0
        assert r["nfe_per_token"] * r["tokens_per_call"] == pytest.approx(1.0)
        assert 1 <= r["steps"] <= G
        # The calls by shape: every call that served a problem, once.
        assert r["projected"] is None and r["calls"]
        row_calls = sum(c["row_calls"] for c in r["calls"])
        assert row_calls == pytest.approx(r["nfe_per_token"] * r["gen_tokens"])
        assert {c["kind"] for c in r["calls"]} == {"full", "cached"}
        # Every call computes the batch, but a full forward serving at most half of it,
        # computed over those rows alone (driver.py, compaction).
        assert all(c["rows"] == batch or (c["kind"] == "full" and 2 * c["rows"] <= batch)
                   for c in r["calls"]), r["calls"]
    assert rows[1]["options"]["early_stop"] is True
    assert rows[1]["speedup_vs_fastest_early_stop"] == pytest.approx(1.0)
    # The published-setting row is the baseline; the early-stop row is compared with it.
    assert rows[0]["speedup_vs_fastest_baseline"] == pytest.approx(1.0)
    assert rows[1]["speedup_vs_fastest_baseline"] == pytest.approx(
        rows[1]["tps"] / rows[0]["tps"])
    # Each variant measured once; the row of the `a|b` spec is its fastest variant.
    assert [v["options"].get("cache") for v in variants] == ["prefix", "dual", "dual"]
    alts = [v for v in variants if v["spec"] == SPECS[0]]
    best = max(alts, key=lambda v: v["tps"])
    # The row is that variant's, options and figures (which one is fastest is up to the
    # machine here; test_the_row_of_a_spec_is_its_fastest_variant pins the choice).
    assert rows[0]["options"] == best["options"]
    assert (rows[0]["tps"], rows[0]["wall_s"]) == (best["tps"], best["wall_s"])
    assert rows[0]["options"]["threshold"] == 0.85


def test_cli_bench_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--model", "tiny-llada", "--samplers", SPECS[1], "--gen-lengths",
               str(G), "--n", "2", "--batch", "2", "--json", str(js), "--plot", str(png),
               "--quiet"])
    assert rc == 0
    data = json.loads(js.read_text())
    assert {"model", "backend", "machine", "n", "batch", "date"} <= set(data["meta"])
    assert len(data["rows"]) == 1 and set(data["rows"][0]) == set(runner.ROW_KEYS)
    assert _png(png)
    assert not list(tmp_path.glob("*.tmp"))
    assert SPECS[1] in capsys.readouterr().out
    md = report.to_markdown(data["rows"], data["meta"])
    table, _, breakdown = md.partition("Per family")
    assert table.count("\n| ") == 2 and "fast-dllm:cache=dual:threshold=0.85" in table
    # The breakdown: a header, a rule and the row, with the row's families and tokens/s.
    row = data["rows"][0]
    assert breakdown.count("\n| ") == 2 and set(row["tps_family"]) == set(
        row["accuracy_family"]) and all(v > 0 for v in row["tps_family"].values())


@pytest.mark.parametrize("argv,needle", [
    (["--samplers", "nope"], "unknown sampler 'nope'"),
    (["--samplers", "fast-dllm:threshold=high"], "threshold='high' is not a float"),
    (["--samplers", "fast-dllm:bogus=1"], "unknown option(s) ['bogus']"),
    (["--samplers", "vanilla", "--gen-lengths", "600"], "do not fit the model"),
    (["--samplers", "vanilla", "--n", "0"], "--n 0"),
    (["--samplers", "vanilla", "--n", "2001"], "the heldout split has 2000 problems"),
    (["--samplers", "vanilla", "--tasks", "v9"], "task set 'v9': expected one of v1, v2"),
])
def test_cli_bench_bad_request_one_line(capsys, argv, needle):
    rc = main(["bench", "--model", "tiny-llada", "--quiet", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err
    assert "Traceback" not in err and err.count("\n") == 1


# ------------------------------------------------------------ the method, call by call

# Three variants of three specs (cheap to validate; nothing is decoded).
METHOD_SPECS = ["vanilla", "fast-dllm:cache=dual", "localleap:cache=dual"]
METHOD_N = 4


class _Spy:
    """Stands in for `generate`: records (variant, problems) per call and returns a
    result whose decode_time is set by `seconds(variant, call number)`."""

    def __init__(self, runs, prompts, seconds=lambda variant, k: 1.0 + k):
        self.runs, self.seconds, self.calls = runs, seconds, []
        self.index = {tuple(p): j for j, p in enumerate(prompts)}

    def __call__(self, model, prompts, *, sampler, gen_length, bucket, tokenizer, **opts):
        variant = self.runs.index((sampler, opts))
        k = len(self.calls)
        self.calls.append((variant, tuple(self.index[tuple(p)] for p in prompts)))
        b = len(prompts)
        stats = types.SimpleNamespace(
            decode_time=self.seconds(variant, k), compile_time=100.0 + k,
            generated_tokens=np.full(b, 8), row_nfe_full=np.ones(b, int),
            row_nfe_partial=np.ones(b, int), row_steps=np.full(b, 2), call_shapes=())
        return types.SimpleNamespace(stats=stats, tokens=np.zeros((b, gen_length), int))


def _spy_run(monkeypatch, specs, n=METHOD_N, batch=1, **kwargs):
    runs = [(name, opts) for _, name, alts in validate(specs, [G]) for opts in alts]
    prompts = evaluate.prompts_for(tasks.split("heldout", n, "v1"))
    spy = _Spy(runs, prompts, **kwargs)
    monkeypatch.setattr(api, "generate", spy)
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(max_seq_len=4096, family="fake"))
    variants = []
    rows = runner.run_bench(model, None, specs, [G], n, batch, progress=False,
                            variants=variants)
    return spy, rows, variants


def test_every_variant_is_compiled_before_the_timed_batches(monkeypatch):
    spy, rows, _ = _spy_run(monkeypatch, METHOD_SPECS)
    R, first = len(METHOD_SPECS), (0,)
    # The warm-up: one call per variant on the first batch, before any timed call.
    assert spy.calls[:R] == [(i, first) for i in range(R)]
    assert len(spy.calls) == R * (METHOD_N + 1)
    # Not timed: a row's decoding seconds are those of its calls after its first
    # (decode_time is 1 + the call's number), and every batch is counted once.
    for i, r in enumerate(rows):
        mine = [k for k, (v, _) in enumerate(spy.calls) if v == i]
        assert mine[0] < R
        assert r["wall_s"] == pytest.approx(sum(1.0 + k for k in mine[1:]))
        assert r["compile_s"] == pytest.approx(sum(100.0 + k for k in mine))
        assert r["tps"] == pytest.approx(8 * METHOD_N / r["wall_s"])
        assert r["steps"] == 2.0
        assert sum(h["n"] for h in r["accuracy_family"].values()) == METHOD_N


@pytest.mark.parametrize("batch", [1, 2])
def test_batches_are_interleaved_each_in_its_own_order(monkeypatch, batch):
    spy, _, _ = _spy_run(monkeypatch, METHOD_SPECS, batch=batch)
    R = len(METHOD_SPECS)
    chunks = [tuple(range(s, min(s + batch, METHOD_N))) for s in range(0, METHOD_N, batch)]
    timed = spy.calls[R:]
    # Batch by batch, every variant once, in the order run_order gives that batch.
    assert timed == [(i, chunk) for c, chunk in enumerate(chunks)
                     for i in runner.run_order(c, R)]


def test_the_run_order_is_not_tied_to_the_family_cycle():
    # Held-out problems cycle through the task set's families; a rotation of two
    # variants gave every problem of a family the same order (one variant always first).
    families = len(tasks.families_of("v4"))
    assert families == 4
    orders = [runner.run_order(c, 2) for c in range(500)]
    assert all(sorted(o) == [0, 1] for o in orders)
    assert orders == [runner.run_order(c, 2) for c in range(500)]  # the same every run
    for f in range(families):
        first = [orders[c][0] for c in range(f, 500, families)]
        assert 0.4 < np.mean(first) < 0.6, f
    # With more variants too, each goes first about as often on each family.
    orders = [runner.run_order(c, 3) for c in range(600)]
    for f in range(families):
        firsts = np.bincount([orders[c][0] for c in range(f, 600, families)], minlength=3)
        assert firsts.min() > 30, (f, firsts)


def test_the_row_of_a_spec_is_its_fastest_variant(monkeypatch):
    # Two specs of two variants each: the faster variant is the second of the first
    # spec and the first of the second, so neither "first" nor "last" passes.
    specs = ["fast-dllm:cache=prefix|dual", "localleap:cache=prefix|dual"]
    slow = {0: 3.0, 1: 1.0, 2: 1.0, 3: 2.0}  # seconds per call, by variant
    spy, rows, variants = _spy_run(monkeypatch, specs, seconds=lambda v, k: slow[v])
    assert [r["options"]["cache"] for r in rows] == ["dual", "prefix"]
    tps = [v["tps"] for v in variants]
    assert tps == pytest.approx([8 / 3.0, 8 / 1.0, 8 / 1.0, 8 / 2.0])
    assert rows[0]["tps"] == tps[1] != tps[0]
    assert rows[1]["tps"] == tps[2] != tps[3]
    assert rows[0]["wall_s"] == pytest.approx(METHOD_N * 1.0)
    # No comparison step was asked for: its fields stay empty.
    assert all(r[f] is None for r in rows for f in runner.COMPARISON_FIELDS)

