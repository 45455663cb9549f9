"""The residual-token analysis: what a block sampler still has to decode in a block once
its first line delimiter is committed, and whether the next line needs it.

AsyncLane forks at a delimiter: a refine lane finishes the masked positions before it
while a continuation lane decodes what follows. For a block sampler (which cannot start
the next block before this one is done) the steps a block spends after its first
delimiter is committed are the steps forking could overlap, and the positions still
masked before that delimiter are the refine lane's work. Whether the next line reads
them decides whether the continuation can go on without them.

For one decoded row (its tokens and `stats.commit_step`), `block_residuals` reports per
content block (a block holding a delimiter and lying before the end of the answer):

  wait_steps  iterations from the step that committed the block's first delimiter (the
              first in time) to the step that completed the block;
  refine      iterations from that step until the last of those residual positions is
              committed (0 when there is none): how long a refine lane forked there lives;
  residual    positions before that delimiter in the block still masked then, each
              classified as free-choice (connective / consequence word), value (a
              number) or format (labels, signs, punctuation, keywords), and flagged when
              the next line reads it (`read_slots`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asynclane_jax.testbed import tokenizer as tok
from asynclane_jax.testbed.words import CONNECTIVES, CONSEQUENCES

KINDS = ("free-choice", "value", "format")


def kind_of(token: str) -> str:
    """free-choice, value or format."""
    if token in CONNECTIVES or token in CONSEQUENCES:
        return "free-choice"
    if token.isdigit():
        return "value"
    return "format"


def read_slots(family: str, line: list[str]) -> set[int]:
    """Indices of the tokens of a working line that the next line reads.

    math  "(i) v s c = r": the result r (the next line starts from it).
    code  "(0) x = X y = Y" and "(i) a s c = r x = X y = Y": the state values X and Y
          (the next statement reads one of them and copies the other).
    chain "(i) C v s c = r , S r": both copies of the result.
    list  nothing: each line reads only its own statement in the prompt.
    walk  "(i) C v s c = r , S r": the result (both copies) and the sign, which sets the
          next line's direction.
    table nothing: each line reads only the header and its own label.
    walk-down, table-down: as walk and table (only their labels differ).
    The answer line is read by nothing.
    """
    if not line or line[0] == "answer":
        return set()
    if family == "math":
        return {5}
    if family == "code":
        return {3, 6} if line[0] == "(0)" else {8, 11}
    if family == "chain":
        return {6, 9}
    if family in ("walk", "walk-down"):
        return {3, 6, 9}
    if family in ("list", "table", "table-down"):
        return set()
    raise ValueError(f"family {family!r}: no reading rule")


@dataclasses.dataclass
class BlockResidual:
    block: int
    wait_steps: int
    refine_steps: int
    masked_before_delimiter: int
    kinds: dict  # KINDS -> count among those positions
    read_by_next_line: int  # of those positions, how many the next line reads
    masked_after_delimiter: int  # the continuation's positions in the block, for scale


def block_residuals(tokens, commit_step, generated: int, block_length: int,
                    family: str) -> list[BlockResidual]:
    """The residual positions of every content block of one row.

    Args:
      tokens: [G] the row's generated token ids (testbed vocabulary).
      commit_step: [G] the iteration that committed each position (`stats.commit_step`).
      generated: tokens before the first end-of-text (`stats.generated_tokens`).
      block_length: the sampler's block length.
      family: the problem's family (for `read_slots`).
    """
    words = tok.decode_tokens(tokens)
    commit_step = np.asarray(commit_step)
    # (line index, index in line) of every generated position before the end of text.
    where, line, j, lines = [], 0, 0, [[]]
    for w in words[:generated]:
        where.append((line, j))
        lines[-1].append(w)
        if w == tok.NEWLINE:
            line, j = line + 1, 0
            lines.append([])
        else:
            j += 1
    reads = [read_slots(family, ln) if ln and ln[-1] == tok.NEWLINE else set()
             for ln in lines]
    out = []
    for b in range(-(-generated // block_length)):
        lo, hi = b * block_length, min((b + 1) * block_length, len(words))
        delims = [p for p in range(lo, min(hi, generated)) if words[p] == tok.NEWLINE]
        if not delims:
            continue
        d = min(delims, key=lambda p: (commit_step[p], p))
        t_fork = commit_step[d]
        before = [p for p in range(lo, d) if commit_step[p] > t_fork]
        after = [p for p in range(d + 1, hi) if commit_step[p] > t_fork]
        kinds = dict.fromkeys(KINDS, 0)
        for p in before:
            kinds[kind_of(words[p])] += 1
        read = sum(1 for p in before if where[p][1] in reads[where[p][0]])
        refine = int(max(commit_step[p] for p in before) - t_fork) if before else 0
        out.append(BlockResidual(b, int(commit_step[lo:hi].max() - t_fork), refine,
                                 len(before), kinds, read, len(after)))
    return out


def summarise(per_row: list[list[BlockResidual]]) -> dict:
    """Means over content blocks, and per problem (mean over rows) the sums of a row's
    wait_steps (iterations after a fork point a block sampler still spends in the block)
    and refine_steps (iterations a refine lane forked there would live)."""
    blocks = [b for row in per_row for b in row]
    if not blocks:
        return {"rows": len(per_row), "blocks": 0}
    masked = sum(b.masked_before_delimiter for b in blocks)
    res = {
        "rows": len(per_row), "blocks": len(blocks),
        "wait_steps_per_block": float(np.mean([b.wait_steps for b in blocks])),
        "refine_steps_per_block": float(np.mean([b.refine_steps for b in blocks])),
        "blocks_that_wait": float(np.mean([b.wait_steps > 0 for b in blocks])),
        "masked_before_delimiter_per_block": masked / len(blocks),
        "masked_after_delimiter_per_block": float(np.mean(
            [b.masked_after_delimiter for b in blocks])),
        "kind_share": {k: (sum(b.kinds[k] for b in blocks) / masked if masked else 0.0)
                       for k in KINDS},
        "read_by_next_line_share": (sum(b.read_by_next_line for b in blocks) / masked
                                    if masked else 0.0),
        "wait_steps_per_row": float(np.mean(
            [sum(b.wait_steps for b in row) for row in per_row])),
        "refine_steps_per_row": float(np.mean(
            [sum(b.refine_steps for b in row) for row in per_row])),
    }
    return res
