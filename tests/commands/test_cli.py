"""The generate / eval / info commands on a small saved model with a real tokenizer."""

import argparse
import json

import pytest

from asynclane_jax import checkpoint
from asynclane_jax.cli import main
from asynclane_jax.models import init_model, tiny_llada
from asynclane_jax.testbed import tokenizer as tb_tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tok_dir = tb_tok.save_tokenizer(root / "tok")
    cfg = tiny_llada(tb_tok.vocab_size()).replace(**tb_tok.special_ids())
    return checkpoint.save(root / "model", init_model(cfg, 0), tokenizer_dir=tok_dir)


def test_generate_json(model_dir, capsys):
    rc = main(["generate", "ann has 7 coins .", "--model", str(model_dir), "--chat",
               "--sampler", "fast-dllm", "--cache", "dual", "--gen-length", "16",
               "--block-length", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "tokens", "stats"}
    assert len(out["tokens"]) == 16
    assert out["stats"]["nfe_full"] == 2  # one refresh per block
    assert out["stats"]["nfe_partial"] == out["stats"]["steps"] - 2
    assert isinstance(out["text"], str)


def test_generate_scan_layers_gives_the_same_tokens(model_dir, capsys):
    argv = ["generate", "ann has 7 coins .", "--model", str(model_dir), "--chat",
            "--sampler", "fast-dllm", "--cache", "dual", "--gen-length", "16",
            "--block-length", "8", "--json"]
    outs = []
    for extra in ([], ["--scan-layers"]):
        assert main(argv + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"]
    assert outs[0]["stats"]["steps"] == outs[1]["stats"]["steps"]


def test_generate_plain_text(model_dir, capsys):
    rc = main(["generate", "ann has 7 coins .", "--model", str(model_dir), "--sampler",
               "vanilla", "--gen-length", "16", "--block-length", "8", "--steps", "8"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "vanilla: " in captured.err and "8 steps" in captured.err


@pytest.mark.parametrize("argv,needle", [
    (["--sampler", "nope"], "unknown sampler 'nope'"),
    (["--sampler", "fast-dllm", "--threshold", "2"], "threshold=2.0 must be in (0, 1]"),
    (["--sampler", "vanilla", "--cache", "dual"], "cache must be 'none'"),
    (["--sampler", "fast-dllm", "--gen-length", "20", "--block-length", "8"],
     "not a multiple of block_length"),
    (["--max-lanes", "0"], "max_lanes=0 must be >= 1"),
])
def test_generate_bad_options_one_line(model_dir, capsys, argv, needle):
    rc = main(["generate", "ann has 7 coins .", "--model", str(model_dir), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_missing_model_is_one_line(tmp_path, capsys):
    rc = main(["generate", "hi", "--model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert rc == 2 and "no model" in err and err.count("\n") == 1


def test_eval_json(model_dir, capsys):
    rc = main(["eval", "--model", str(model_dir), "--sampler", "fast-dllm", "--n", "4",
               "--gen-length", "16", "--block-length", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 4 and 0.0 <= out["accuracy"] <= 1.0
    assert out["nfe_per_token"] > 0 and out["tps"] > 0


def test_evaluate_resumes_where_it_stopped(model_dir, tmp_path, capsys):
    """A run stopped after 2 problems and resumed to 4 records what one run of 4 does;
    a resume with other settings is refused in one line, the file left as it was."""
    from asynclane_jax.testbed import evaluate

    base = [str(model_dir), "--sampler", "fast-dllm", "--gen-length", "16",
            "--block-length", "8", "--batch-size", "2"]
    whole, part = tmp_path / "whole.json", tmp_path / "part.json"
    evaluate.main([*base, "--n", "4", "--out", str(whole)])
    evaluate.main([*base, "--n", "2", "--out", str(part)])
    assert len(json.loads(part.read_text())["per_problem"]) == 2
    evaluate.main([*base, "--n", "4", "--out", str(part), "--resume"])
    got, want = json.loads(part.read_text()), json.loads(whole.read_text())
    assert got["per_problem"] == want["per_problem"] and got["n"] == 4
    for key in ("accuracy", "line_accuracy", "correct", "accuracy_length"):
        assert got[key] == want[key], key
    assert got["tally"]["rows"] == 4 and got["tally"]["gen_tokens"] == want["tally"]["gen_tokens"]
    capsys.readouterr()
    before = part.read_text()
    with pytest.raises(SystemExit) as e:
        evaluate.main([*base[:-2], "--batch-size", "2", "--gen-length", "32", "--n", "4",
                       "--out", str(part), "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "other settings (gen_length: 16 there, 32 here)" in err
    assert part.read_text() == before


def test_evaluate_on_chosen_families_and_buckets(model_dir, tmp_path, capsys):
    """--families and --buckets decode only the first --n problems in them: the result
    names their indices in the split, counts only them, and a resume with other
    choices is refused; an unknown name is refused before any decode."""
    from asynclane_jax.testbed import evaluate, tasks

    base = [str(model_dir), "--sampler", "fast-dllm", "--gen-length", "16",
            "--block-length", "8", "--batch-size", "2", "--n", "8"]
    out = tmp_path / "math.json"
    evaluate.main([*base, "--families", "math", "--out", str(out)])
    got = json.loads(out.read_text())
    problems = tasks.split("heldout", 8, got["task_set"])
    want = [i for i, p in enumerate(problems) if p.family == "math"]
    assert got["problems"] == want and 0 < len(want) < 8
    assert got["n"] == len(want) == len(got["per_problem"]) == got["n_math"]
    assert got["families"] == ["math"] and got["buckets"] is None
    assert [k for k in got if k.startswith("n_")] == ["n_math"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        evaluate.main([*base, "--families", "code", "--out", str(out), "--resume"])
    assert e.value.code == 2
    assert "families: ['math'] there, ['code'] here" in capsys.readouterr().err
    for flag, name, what in (("--buckets", ">999", "answer-length bucket"),
                             ("--families", "poetry", "family")):
        with pytest.raises(SystemExit) as e:
            evaluate.main([*base, flag, name])
        assert e.value.code == 2
        assert f"unknown {what} {name!r}" in capsys.readouterr().err
    # The buckets are the answers' lengths as the results split them.
    pool = tasks.split("heldout", 200, "v4")
    long = evaluate.select(pool, "v4", buckets=[">256"])
    assert long and all(tasks.answer_tokens(pool[i]) > 256 for i in long)
    assert len(long) == sum(tasks.answer_tokens(p) > 256 for p in pool)


def test_info_on_a_converted_folder(model_dir, capsys):
    assert main(["info", "--model", str(model_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == sum(
        v.size for v in __import__("jax").tree.leaves(checkpoint.params_to_numpy(
            checkpoint.load_model(model_dir))))


@pytest.mark.parametrize("argv,needle", [
    (["generate", "ann has 7 coins .", "--gen-length", "0"], "--gen-length 0: must be positive"),
    (["eval", "--n", "0"], "--n 0: must be a positive number"),
])
def test_zero_lengths_are_one_line_errors(model_dir, capsys, argv, needle):
    rc = main([*argv, "--model", str(model_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and needle.replace(": must be positive", "") in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_words_outside_the_vocabulary_are_named(model_dir, capsys):
    rc = main(["generate", "What is 12 plus 30 ?", "--model", str(model_dir),
               "--gen-length", "16", "--block-length", "8"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "outside the model's vocabulary" in err
    assert "'What'" in err and "'plus'" in err and "'12'" not in err


def test_every_sampler_option_is_a_flag(capsys):
    """The CLI's sampler flags come from the schedules' fields, with their docs."""
    from asynclane_jax.decoding.registry import option_docs, option_fields, samplers

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for cls in samplers().values():
        docs = option_docs(cls)
        for name in option_fields(cls):
            assert "--" + name.replace("_", "-") in help_text, name
            assert docs.get(name), f"{cls.name}.{name} has no docstring entry"
            assert " ".join(docs[name].split()[:4]) in help_text, name


@pytest.mark.parametrize("flag,switch", [("compact-full", "COMPACT_FULL"),
                                         ("mixed-calls", "MIXED_CALLS")])
def test_driver_switch_flags_reach_the_driver(monkeypatch, flag, switch):
    """Every decoding command takes `--FLAG` and `--no-FLAG`, and `main` sets the
    driver's switch from it before the command runs (unchanged when neither is given)."""
    from asynclane_jax import cli, compile_cache
    from asynclane_jax.decoding import driver

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in compile_cache.COMMANDS:
        if name in sub.choices:
            flags = {s for a in sub.choices[name]._actions for s in a.option_strings}
            assert {f"--{flag}", f"--no-{flag}"} <= flags, name
    state = getattr(driver, switch)
    seen = []
    monkeypatch.setattr(cli, "run_command", lambda args: seen.append(state["on"]))
    monkeypatch.setitem(state, "on", True)
    cli.main(["generate", "p", "--model", "x", f"--no-{flag}"])
    cli.main(["generate", "p", "--model", "x"])
    cli.main(["serve", "--model", "x", f"--{flag}"])
    assert seen == [False, False, True]
