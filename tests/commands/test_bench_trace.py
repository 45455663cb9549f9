"""The bench command (asynclane_jax.bench) and the decode-order picture
(asynclane_jax.decoding.trace), on the shipped tiny-llada."""

import dataclasses
import json

import numpy as np
import pytest

import asynclane_jax
from asynclane_jax import bench
from asynclane_jax.cli import main
from asynclane_jax.decoding.lanes import DONE, FREE, GENERATE, LANE_KINDS, TERMINATED, LaneStats
from asynclane_jax.decoding.registry import samplers
from asynclane_jax.decoding.trace import plot_decode_order, save_decode_order, shown_length
from asynclane_jax.errors import UsageError
from asynclane_jax.testbed import evaluate, tasks

G = 64
# A threshold no other test uses: these programs are compiled here first (compile_s > 0).
SPECS = ["fast-dllm:cache=prefix|dual:threshold=0.85",
         "fast-dllm:cache=dual:threshold=0.85:early_stop=true"]


@pytest.fixture(scope="module")
def tiny():
    return asynclane_jax.load("tiny-llada")


@pytest.fixture(scope="module")
def fast_result(tiny):
    """fast-dllm on the first held-out problem, the same program the bench compiles."""
    model, tok, _ = tiny
    prompts = evaluate.prompts_for(tasks.split("heldout", 2), tok)
    return asynclane_jax.generate(model, prompts[:1], sampler="fast-dllm", gen_length=G,
                                  cache="dual", threshold=0.85,
                                  bucket=max(len(p) for p in prompts))


def _png(path):
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------- specs

def test_parse_spec_alternatives_and_defaults():
    assert bench.parse_spec("vanilla") == ("vanilla", [{}])
    assert bench.parse_spec("fast-dllm:cache=dual:threshold=0.8") == (
        "fast-dllm", [{"cache": "dual", "threshold": 0.8}])
    name, variants = bench.parse_spec("localleap:early_stop=true:radius=2|4")
    assert name == "localleap"
    assert variants == [{"early_stop": True, "radius": 2, "cache": "prefix"},
                        {"early_stop": True, "radius": 2, "cache": "dual"},
                        {"early_stop": True, "radius": 4, "cache": "prefix"},
                        {"early_stop": True, "radius": 4, "cache": "dual"}]
    assert bench.parse_spec("fast-dllm")[1] == [{"cache": "prefix"}, {"cache": "dual"}]


@pytest.mark.parametrize("spec,needle", [
    ("", "no sampler name"), ("fast-dllm:cache", "not key=value"),
    ("fast-dllm:cache=dual:cache=prefix", "given twice"), ("fast-dllm:cache=dual|", "empty"),
])
def test_parse_spec_errors(spec, needle):
    with pytest.raises(UsageError, match=needle):
        bench.parse_spec(spec)


def test_default_specs_are_registered():
    specs = bench.default_specs()
    assert specs and all(s.split(":")[0] in samplers() for s in specs)
    assert ("asynclane" in specs) == ("asynclane" in samplers())


def test_speedups():
    def row(sampler, tps, **opts):
        return {"sampler": sampler, "tps": tps, "gen_length": 128, "options": opts}

    rows = bench.add_speedups([row("vanilla", 10.0), row("fast-dllm", 40.0),
                               row("fast-dllm:early_stop=true", 50.0, early_stop=True),
                               row("asynclane", 100.0)])
    assert [r["speedup_vs_fastest_baseline"] for r in rows] == [0.25, 1.0, 1.25, 2.5]
    assert [r["speedup_vs_fastest_early_stop"] for r in rows] == [0.2, 0.8, 1.0, 2.0]
    lone = bench.add_speedups([row("vanilla", 10.0)])[0]
    assert lone["speedup_vs_fastest_baseline"] == 1.0
    assert lone["speedup_vs_fastest_early_stop"] is None


# ------------------------------------------------------------------------- bench runs

@pytest.mark.parametrize("batch", [1, 2])
def test_run_bench_rows(tiny, batch):
    model, tok, _ = tiny
    variants, seen = [], []
    rows = bench.run_bench(model, tok, SPECS, [G], 2, batch, progress=False,
                           on_length=seen.append, model_name="tiny-llada", variants=variants)
    assert len(seen) == 1 and seen[0] == rows
    assert [r["sampler"] for r in rows] == SPECS
    for r in rows:
        assert set(r) == set(bench.ROW_KEYS)
        assert (r["model"], r["gen_length"], r["n"], r["batch"]) == ("tiny-llada", G, 2, batch)
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["tps"] > 0 and r["wall_s"] > 0 and r["compile_s"] > 0
        assert r["nfe_per_token"] * r["tokens_per_call"] == pytest.approx(1.0)
        assert 1 <= r["steps"] <= G
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
    assert rows[0]["options"] == best["options"]
    assert rows[0]["tps"] == best["tps"] == max(v["tps"] for v in alts)
    assert rows[0]["options"]["threshold"] == 0.85


def test_cli_bench_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--model", "tiny-llada", "--samplers", SPECS[1], "--gen-lengths",
               str(G), "--n", "2", "--batch", "2", "--json", str(js), "--plot", str(png),
               "--quiet"])
    assert rc == 0
    data = json.loads(js.read_text())
    assert {"model", "backend", "machine", "n", "batch", "date"} <= set(data["meta"])
    assert len(data["rows"]) == 1 and set(data["rows"][0]) == set(bench.ROW_KEYS)
    assert _png(png)
    assert not list(tmp_path.glob("*.tmp"))
    assert SPECS[1] in capsys.readouterr().out
    md = bench.to_markdown(data["rows"], data["meta"])
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


# ------------------------------------------------------------------------- the picture

def test_shown_length_cuts_an_end_of_text_tail():
    toks = np.array([5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    assert shown_length(toks, 3, [0], margin=2) == 5
    assert shown_length(toks, 3, [9], margin=2) == 12  # tail not end-of-text
    assert shown_length(toks[:3], 3, [0]) == 3


def test_trace_block_boundaries(fast_result, tiny, tmp_path):
    _, tok, _ = tiny
    fig = save_decode_order(fast_result, tmp_path / "order.png", tokenizer=tok, stop_ids=[])
    assert _png(tmp_path / "order.png")
    assert fig.shown_positions == G
    assert fig.block_boundaries == [32]
    assert fig.lane_patches == []
    cut = plot_decode_order(fast_result, stop_ids=[0])
    n = int(fast_result.stats.generated_tokens[0])
    if n < G:
        assert cut.shown_positions < G and "not shown" in cut.get_suptitle()


def test_trace_lane_tree(fast_result, tmp_path):
    st = fast_result.stats
    fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    # Root lane [0, 24) done at step 5; forks at 24 (step 2) and 44 (step 3, terminated).
    lanes = LaneStats(**fields,
                      lane_kind=np.array([[DONE, GENERATE, TERMINATED, FREE]]),
                      lane_start=np.array([[0, 24, 44, 0]]),
                      lane_end=np.array([[24, 44, 64, 0]]),
                      lane_parent=np.array([[-1, 0, 1, -1]]),
                      lane_birth=np.array([[0, 2, 3, -1]]),
                      lane_death=np.array([[5, -1, 4, -1]]))
    assert [lane["kind"] for lane in lanes.lane_tree(0)] == [LANE_KINDS[k] for k in
                                                             (DONE, GENERATE, TERMINATED)]
    res = dataclasses.replace(fast_result, stats=lanes)
    fig = save_decode_order(res, tmp_path / "lanes.png")
    assert _png(tmp_path / "lanes.png")
    assert len(fig.lane_patches) == 3
    assert fig.block_boundaries == []
    first = fig.lane_patches[0]
    assert (first.get_x(), first.get_width(), first.get_y(), first.get_height()) == (
        -0.5, 24, -0.5, 6)
    assert fig.shown_positions >= 44  # every fork point in view


def test_cli_generate_trace(tmp_path, capsys):
    png = tmp_path / "trace.png"
    rc = main(["generate", "x = 4 y = 7 (1) x = y + 2 print y", "--chat", "--gen-length",
               str(G), "--trace", str(png)])
    assert rc == 0 and _png(png)
    assert "decode order drawn" in capsys.readouterr().err


def test_spec_on_another_model():
    assert bench.split_model("d2f:skip_threshold=0.8@tiny-llada-d2f") == (
        "d2f:skip_threshold=0.8", "tiny-llada-d2f")
    assert bench.split_model("fast-dllm") == ("fast-dllm", None)
    with pytest.raises(UsageError, match="no model name"):
        bench.split_model("d2f@")
    # Validation sees through the model part.
    assert bench.validate(["d2f:skip_threshold=0.8@tiny-llada-d2f"], [64])[0][1] == "d2f"
