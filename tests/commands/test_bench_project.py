"""`asynclane-jax bench --project CHIPS`: each row's tokens/s projected on other chips
from the model calls it recorded (asynclane_jax.bench.project, asynclane_jax.costs)."""

import json
import types

import pytest

from asynclane_jax.bench import project, report
from asynclane_jax.cli import main
from asynclane_jax.costs import roofline
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.errors import UsageError
from asynclane_jax.models import preset

FULL = CallShape("full", 1, 640, 640, 32, True, 640)
CACHED = CallShape("cached", 1, 32, 640, 32, True, 640)


def _row(calls, tokens=200):
    return {"sampler": "fast-dllm:cache=dual",
            "calls": [{**s.to_dict(), "calls": n, "row_calls": n} for s, n in calls],
            "gen_tokens": tokens, "projected": None}


def test_parse_chips_defaults_and_labels():
    assert project.parse_chips("v6e,h200") == [("v6e", "bf16"), ("h200", "bf16")]
    # The 8B preset's bfloat16 weights do not fit one v5e: int8 unless asked otherwise.
    assert project.parse_chips("v5e") == [("v5e", "int8")]
    assert project.parse_chips(" cpu , v5e:bf16 ") == [("cpu", "bf16"), ("v5e", "bf16")]
    assert [project.label(*c) for c in project.parse_chips("cpu,v5e,v6e:int8,h200")] == [
        "cpu", "v5e-int8", "v6e-int8", "h200"]


@pytest.mark.parametrize("text,needle", [
    ("tpu9", "unknown chip 'tpu9'"), ("v6e:fp4", "weights 'fp4'"),
    ("cpu:int8", "takes no weights"), ("v6e,v6e", "named twice"), (" , ", "at least one"),
])
def test_parse_chips_errors(text, needle):
    with pytest.raises(UsageError, match=needle):
        project.parse_chips(text)


def test_projections_price_each_recorded_call():
    cfg = preset("llada-8b-instruct")
    rows = [_row([(FULL, 4), (CACHED, 12)]), _row([(FULL, 2), (CACHED, 30)], tokens=300)]
    project.add_projections(rows, project.parse_chips("v6e,v5e"), cfg)
    for row in rows:
        counts = project.row_counts(row)
        for label, chip, weights in (("v6e", "v6e", "bf16"), ("v5e-int8", "v5e", "int8")):
            seconds = roofline.decode_time(chip, cfg, counts, weights=weights)
            assert row["projected"][label] == pytest.approx(row["gen_tokens"] / seconds)
    # More calls for the same tokens: slower; the faster chip: faster.
    assert rows[0]["projected"]["v6e"] > rows[0]["projected"]["v5e-int8"]


def test_cpu_is_priced_by_the_measured_calls():
    class Measured:
        cfg = preset("tiny-llada-test")

        def call_time(self, shape):
            return {FULL: 0.010, CACHED: 0.002}[shape]

    costs = project.CpuCosts(types.SimpleNamespace(cfg=Measured.cfg), calls=Measured())
    costs.overhead = lambda row: 0.001  # seconds per call outside the calls
    rows = [_row([(FULL, 4), (CACHED, 10)], tokens=120)]
    assert costs.row_seconds(rows[0]) == pytest.approx((0.060, 0.014))
    project.add_projections(rows, [("cpu", "bf16")], None, measure=costs)
    assert rows[0]["projected"] == {"cpu": pytest.approx(120 / 0.074)}
    with pytest.raises(UsageError, match="no measurement"):
        project.add_projections(rows, [("cpu", "bf16")], None)


def test_cli_bench_project(tmp_path, capsys):
    js = tmp_path / "bench.json"
    rc = main(["bench", "--model", "tiny-llada", "--samplers", "fast-dllm:cache=dual",
               "--gen-lengths", "64", "--n", "2", "--quiet", "--json", str(js),
               "--project", "cpu,v6e,h200"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "v6e tokens/s*" in out and "projections, not measurements" in out
    data = json.loads(js.read_text())
    assert data["meta"]["project_model"] == "llada-8b-instruct"
    assert data["meta"]["projected"] == ["cpu", "v6e", "h200"]
    row = data["rows"][0]
    assert set(row["projected"]) == {"cpu", "v6e", "h200"}
    assert all(v > 0 for v in row["projected"].values())
    # An H200 reads the weights faster than a v6e: the weight-bound 8B decodes faster.
    assert row["projected"]["h200"] > row["projected"]["v6e"]
    md = report.to_markdown(data["rows"], data["meta"])
    assert "h200 tokens/s*" in md and "projections, not measurements" in md


@pytest.mark.parametrize("argv,needle", [
    (["--project", "v7x"], "unknown chip 'v7x'"),
    (["--project-model", "llada-8b-base"], "--project-model needs --project"),
    (["--project", "v6e", "--project-model", "nope-1b"], "--project-model 'nope-1b'"),
])
def test_cli_bench_project_errors(capsys, argv, needle):
    rc = main(["bench", "--model", "tiny-llada", "--samplers", "vanilla", "--quiet",
               "--gen-lengths", "32", "--n", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
