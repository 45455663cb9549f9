"""Hostile command lines: prompts that are not UTF-8, absurd --n, and hypothesis
fuzzing of every option: one line on stderr and exit status 2, never a traceback.
Helpers: tests/hostile.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from hostile import FAST, FUZZ, _one_parser, one_line, one_parser, refused  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from asynclane_jax.cli import main

# --------------------------------------------------------------------------- prompts, --n

def test_non_utf8_prompt(capsys):
    """argv bytes that are not UTF-8 arrive as surrogateescape text (as here)."""
    err = refused(capsys, "generate", "caf\udce9 \udcff", "--model", "tiny-llada",
                  needle="not valid UTF-8")
    assert "0xe9" in err


def test_non_utf8_prompt_bytes_in_a_real_process():
    cmd = [os.path.join(os.path.dirname(sys.executable), "asynclane-jax").encode(),
           b"generate", b"caf\xe9", b"--model", b"tiny-llada"]
    res = subprocess.run(cmd, capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 2, err
    one_line(err)
    assert "not valid UTF-8" in err and "0xe9" in err


@pytest.mark.parametrize("n", ["1000000000", "2001"])
def test_absurd_eval_n(capsys, n):
    refused(capsys, "eval", "--n", n, needle=f"--n {n}: the held-out split has 2000 problems")


def test_evaluate_bounds_n():
    from asynclane_jax.testbed.evaluate import evaluate

    t = time.process_time()
    for n in (10**9, 0, 2.5, True):
        with pytest.raises(ValueError, match="problems"):
            evaluate(None, n=n)
    with pytest.raises(ValueError, match="train split has 100000"):
        evaluate(None, n=10**9, split="train")
    assert time.process_time() - t < FAST


# Text an argv can carry: no NUL; non-UTF-8 bytes arrive as lone surrogates.
ARG = st.one_of(st.text(st.characters(blacklist_characters="\0"), max_size=20),
                st.integers(-(2**70), 2**70).map(str),
                st.sampled_from(["nan", "inf", "-1", "0", "1e9", "~nobody/x", "/", ".",
                                 "x" * 300, "\udcff\udcfe", "--help"]))


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_fuzz_cli_options_never_show_a_traceback(tmp_path_factory, monkeypatch, data):
    """Garbage in every option (the model is never a real one, so nothing heavy runs):
    an argparse refusal (exit 2) or one line, never a traceback. stderr is a StringIO:
    like a real terminal's (errors="backslashreplace") it shows any text."""
    import contextlib
    import io

    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    arg = lambda: data.draw(ARG).lstrip("-") or "x"
    model = "no-such-model-" + arg()
    argv = data.draw(st.sampled_from([
        ["generate", data.draw(ARG), "--model", model, "--gen-length", arg()],
        ["generate", data.draw(ARG), "--model", arg() + "/missing", "--seed", arg()],
        ["eval", "--n", arg(), "--model", model],
        ["eval", "--n", "4", "--model", model, "--gen-length", arg()],
        ["info", "--model", arg() + "/missing"],
        ["verify", arg() + "/missing"],
        ["convert", arg() + "/missing", arg(), "--no-progress"],
        ["convert", arg() + "/missing", "dst", "--lora", arg(), "--dtype", arg()],
    ]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage and the error, exit 2
            rc = e.code
    err = err.getvalue()
    assert rc in (0, 2), (argv, err)
    assert "Traceback" not in err, (argv, err)
    # A name holding a line break is echoed as it is: one line is for the rest.
    if rc == 2 and not err.startswith("usage:") and not any(
            c in a for a in argv for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"):
        one_line(err)
