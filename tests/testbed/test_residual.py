"""The residual-token analysis on hand-made decode orders."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asynclane_jax.testbed import residual, tasks
from asynclane_jax.testbed import tokenizer as tok


def _row(problem, gen_length=48):
    ids = tok.encode(problem.response)
    eos = tok.special_ids()["eos_token_id"]
    return np.array(ids + [eos] * (gen_length - len(ids))), len(ids)


def test_a_chain_block_with_two_residual_positions():
    p = tasks.make_chain(random.Random(0), 3)
    tokens, generated = _row(p)
    words = tok.decode_tokens(tokens)
    assert words[10] == tok.NEWLINE and words[1] in residual.CONNECTIVES
    steps = np.ones(len(tokens), int)
    steps[10] = 2          # the first delimiter
    steps[1] = 5           # its connective (free choice) still masked until step 5
    steps[6] = 4           # its result (a value the next line reads) until step 4
    steps[11:16] = 3       # the next line's first positions in the same block
    steps[16:] = 6         # the second block
    blocks = residual.block_residuals(tokens, steps, generated, 16, "chain")
    first = blocks[0]
    assert first.block == 0 and first.wait_steps == 3 and first.refine_steps == 3
    assert first.masked_before_delimiter == 2
    assert first.kinds == {"free-choice": 1, "value": 1, "format": 0}
    assert first.read_by_next_line == 1 and first.masked_after_delimiter == 5
    # Nothing is masked before the second block's first delimiter at its step.
    assert blocks[1].masked_before_delimiter == 0 and blocks[1].refine_steps == 0
    s = residual.summarise([blocks])
    assert s["blocks"] == len(blocks) and s["kind_share"]["free-choice"] == pytest.approx(0.5)
    assert s["read_by_next_line_share"] == pytest.approx(0.5)
    assert s["refine_steps_per_row"] == 3


def test_list_lines_are_read_by_nothing_and_end_of_text_blocks_are_skipped():
    p = tasks.make_list(random.Random(1), 2)
    tokens, generated = _row(p, gen_length=64)
    steps = np.arange(len(tokens))[::-1].copy()  # right to left: everything is residual
    blocks = residual.block_residuals(tokens, steps, generated, 16, "list")
    assert len(blocks) == -(-generated // 16) - sum(
        tok.NEWLINE not in tok.decode_tokens(tokens[b * 16:min((b + 1) * 16, generated)])
        for b in range(-(-generated // 16)))
    assert all(b.read_by_next_line == 0 for b in blocks)
    assert blocks[0].masked_before_delimiter == 10  # the whole first line
    with pytest.raises(ValueError):
        residual.read_slots("poetry", ["(1)"])
