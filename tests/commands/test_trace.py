"""The decode-order picture (asynclane_jax.decoding.trace), on the shipped tiny-llada."""

import dataclasses

import numpy as np
import pytest

import asynclane_jax
from asynclane_jax.cli import main
from asynclane_jax.decoding.lanes import DONE, FREE, GENERATE, LANE_KINDS, TERMINATED, LaneStats
from asynclane_jax.decoding.trace import plot_decode_order, save_decode_order, shown_length
from asynclane_jax.testbed import evaluate, tasks

G = 64


@pytest.fixture(scope="module")
def tiny():
    return asynclane_jax.load("tiny-llada")


@pytest.fixture(scope="module")
def fast_result(tiny):
    """fast-dllm on the first held-out problem (at its published threshold: the bench
    tests' threshold is compiled there first)."""
    model, tok, _ = tiny
    prompts = evaluate.prompts_for(tasks.split("heldout", 2), tok)
    return asynclane_jax.generate(model, prompts[:1], sampler="fast-dllm", gen_length=G,
                                  cache="dual", bucket=max(len(p) for p in prompts))


def _png(path):
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
