"""Answer checks of the lm-eval tasks in `tasks/` (their `process_results` and filters).

  testbed          the testbed's own check (asynclane_jax.testbed.tasks.check).
  gsm8k, math500   math-verify: the gold answer and the response are parsed (LaTeX and
                   plain expressions, \\boxed{}, "the answer is ...") and compared
                   symbolically.
  humaneval, mbpp  the completion and the problem's tests run in the sandbox (an isolated
                   process with time, memory and process limits: asynclane_jax.harness.
                   sandbox); a program passes only when its tests ran to their end.
                   pass@1 over one greedy sample. The runs happen in a filter, all of a
                   task at once on a thread pool, before the per-document metric reads
                   their outcome; `sandbox_report()` says which isolation they had.
"""

from __future__ import annotations

import collections
import json
import re

from asynclane_jax.harness import require, sandbox

# Limits of each code run; `asynclane-jax lm-eval` sets them from its flags.
SANDBOX = {"timeout": 10.0, "memory_mb": 1024, "workers": None, "progress": True}
# Programs run since the last reset_sandbox_report(), per isolation name.
_ISOLATIONS: collections.Counter = collections.Counter()


# ----------------------------------------------------------------------------- testbed

def testbed(doc: dict, results: list[str]) -> dict:
    from asynclane_jax.testbed import tasks

    problem = tasks.Problem(doc["family"], doc["prompt"], doc["response"], int(doc["answer"]))
    return {"exact_match": float(tasks.check(problem, results[0]))}


# ----------------------------------------------------------------------------- math

def math_equal(gold: str, response: str) -> bool:
    """math-verify's verdict: does the response's final answer equal the gold answer?"""
    mv = require("math_verify")
    gold_parsed = mv.parse(f"\\boxed{{{gold}}}")
    if not gold_parsed:
        gold_parsed = mv.parse(gold)
    return bool(gold_parsed) and bool(mv.verify(gold_parsed, mv.parse(response)))


def gsm8k_gold(answer: str) -> str:
    """The number after GSM8K's "####", thousands separators dropped."""
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(math_equal(gsm8k_gold(doc["answer"]), results[0]))}


def math500(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(math_equal(doc["answer"], results[0]))}


# ----------------------------------------------------------------------------- code

_FENCE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str) -> str:
    """The first fenced code block of a response (up to its end, or the end of the text
    when it is not closed); the text itself when it has no fence."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def humaneval_program(doc: dict, completion: str) -> str:
    """The prompt and its completion, then HumanEval's tests. A response that writes the
    whole function (a chat answer in a code block) follows the prompt and replaces the
    prompt's function (a def whose body is only its docstring)."""
    code = extract_code(completion) if "```" in completion else completion
    if re.search(rf"^def\s+{re.escape(doc['entry_point'])}\s*\(", code, re.M):
        body = doc["prompt"] + "    pass\n\n" + code
    else:
        body = doc["prompt"] + code
    return f"{body}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_program(doc: dict, completion: str) -> str:
    """The setup code, the completed function, then the problem's asserts."""
    code = extract_code(completion) if "```" in completion else completion
    code = code.replace("[BEGIN]", "").split("[DONE]")[0]
    tests = "\n".join(doc["test_list"])
    return f"{doc.get('test_setup_code') or ''}\n{code}\n\n{tests}\n"


def _execute(resps: list[list[str]], docs: list[dict], build, desc: str) -> list[list[str]]:
    programs, where = [], []
    for i, (rs, doc) in enumerate(zip(resps, docs)):
        for j, r in enumerate(rs):
            programs.append(build(doc, r))
            where.append((i, j))
    results = sandbox.run_many(programs, workers=SANDBOX["workers"],
                               progress=SANDBOX["progress"], desc=desc,
                               timeout=SANDBOX["timeout"], memory_mb=SANDBOX["memory_mb"])
    out = [[""] * len(rs) for rs in resps]
    for (i, j), res in zip(where, results):
        _ISOLATIONS[res.isolation] += 1
        out[i][j] = json.dumps({"status": res.status, "isolation": res.isolation,
                                "stderr": res.stderr[-500:]})
    return out


def reset_sandbox_report() -> None:
    _ISOLATIONS.clear()


def sandbox_report() -> dict | None:
    """How the code runs since reset_sandbox_report() were isolated: {"isolation": the
    name (several joined by ", " if they differed), "programs": {name: count}, "detail",
    "not_guaranteed": [keys of sandbox.GUARANTEES], "missing": [...]}; None when no code
    ran."""
    if not _ISOLATIONS:
        return None
    iso = sandbox.isolation_info()
    return {"isolation": ", ".join(sorted(_ISOLATIONS)), "programs": dict(_ISOLATIONS),
            "detail": iso.detail, "not_guaranteed": iso.not_guaranteed,
            "missing": list(iso.missing)}


def execute_humaneval(resps, docs):
    """lm-eval filter: every completion with its tests through the sandbox; each response
    becomes the JSON of its outcome ({"status", "isolation", "stderr"})."""
    return _execute(resps, docs, humaneval_program, "humaneval tests")


def execute_mbpp(resps, docs):
    return _execute(resps, docs, mbpp_program, "mbpp tests")


def pass_at_1(doc: dict, results: list[str]) -> dict:
    return {"pass@1": float(json.loads(results[0])["status"] == "passed")}
