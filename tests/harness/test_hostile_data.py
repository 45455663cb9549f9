"""Hostile dataset rows: a bad row of a benchmark file is named (row number, what is
wrong, the file), by `harness.data.load_rows` and through the harness command, in one
line. Helpers: tests/hostile.py.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from hostile import one_line

# --------------------------------------------------------------------------- dataset rows

def _jsonl(path: pathlib.Path, rows) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in rows))
    return path


HUMANEVAL_ROW = {"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "def check(f): "
                 "assert f() == 1\n", "entry_point": "f", "canonical_solution": "  return 1\n"}


@pytest.mark.parametrize("key, rows, needle", [
    ("gsm8k", [{"question": "q", "answer": "#### 1"}] * 2 + [{"question": "q"}],
     "row 3 has no answer"),
    ("humaneval", [HUMANEVAL_ROW, {k: v for k, v in HUMANEVAL_ROW.items() if k != "test"}],
     "row 2 has no test (bad data, not a problem to score)"),
    ("humaneval", [HUMANEVAL_ROW, dict(HUMANEVAL_ROW, test=None)], "row 2 has no test"),
    ("humaneval", [HUMANEVAL_ROW, dict(HUMANEVAL_ROW, test="  ")], "empty column(s) test"),
    ("mbpp", [{"text": "t", "code": "c", "test_list": "assert 1"}],
     "wrong type: test_list (str)"),
    ("math500", [{"problem": "p", "answer": "1"}, [1, 2]], "row 2 is a list"),
    ("gsm8k", [{"question": "q", "answer": "1"}, "{not json"], "line 2 is not JSON"),
])
def test_bad_dataset_rows(tmp_path, key, rows, needle):
    from asynclane_jax.harness import data

    path = _jsonl(tmp_path / "test.jsonl", rows)
    with pytest.raises(data.DataError) as e:
        data.load_rows(key, path)
    assert needle in str(e.value) and str(path) in str(e.value)


def test_bad_dataset_row_through_the_command(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from asynclane_jax.harness import cli as harness_cli

    path = _jsonl(tmp_path / "test.jsonl", [{"question": "q", "answer": "1"}, {"answer": "2"}])
    rc = harness_cli.main(["--model", "tiny-llada", "--tasks", "gsm8k", "--data",
                           f"gsm8k={path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "row 2 has no question" in err
    one_line(err)
