"""The task sets v3 and v4: walk (chained) and table (independent), with a fixed-length
header; v4 has the same problems with their labels counting down (walk-down, table-down)."""

from __future__ import annotations

import random

import pytest

from asynclane_jax.testbed import tasks, train
from asynclane_jax.testbed import tokenizer as tok


def _header(p: tasks.Problem) -> tuple[int, int, int]:
    """The two numbers and the line count of a walk / table prompt, read from its words:
    "walk from S by D : lines (1) to (N) ." or "table of A from S : lines (1) to (N) .". """
    w = p.prompt.split()
    assert len(w) == 11 and w[5:9] == [":", "lines", "(1)", "to"] and w[-1] == "."
    return int(w[2]), int(w[4]), int(w[9][1:-1])


def _working(p: tasks.Problem) -> list[list[str]]:
    return [ln.split() for ln in tasks.parse_lines(p.response)[:-1]]


def test_walk_lines_read_the_line_before_and_reflect_at_both_ends():
    """Simulated from the prompt's words alone: each line starts from the previous
    line's result, keeps the previous direction (up at first) unless it would leave
    0..9, and the answer is the last result."""
    walks = [p for p in tasks.heldout(400, "v3") if p.family == "walk"]
    assert len(walks) == 100
    turned = 0
    for p in walks:
        value, step, n = _header(p)
        lines, up = _working(p), True
        assert len(lines) == n
        for i, t in enumerate(lines, 1):
            nxt = value + step if up else value - step
            if not 0 <= nxt <= 9:
                up, turned = not up, turned + 1
                nxt = value + step if up else value - step
            assert t[0] == f"({i})" and t[2:7] == [str(value), "+" if up else "-", str(step),
                                                   "=", str(nxt)]
            assert t[7] == "," and t[9] == t[6]
            value = nxt
        assert p.answer == value and tasks.parse_lines(p.response)[-1] == f"answer : {value}"
    assert turned > 100  # the walks do turn, often


def test_table_lines_read_only_the_header_and_their_own_label():
    tables = [p for p in tasks.heldout(400, "v3") if p.family == "table"]
    assert len(tables) == 100
    for p in tables:
        add, start, n = _header(p)
        lines = _working(p)
        assert len(lines) == n
        for i, t in enumerate(lines, 1):
            row = (start + i - 1) % 10
            assert t[0] == f"({i})" and t[2:7] == [str(row), "+", str(add), "=", str(row + add)]
            assert t[9] == t[6]
        assert p.answer == (start + n - 1) % 10 + add


def test_a_table_line_does_not_change_with_another_line():
    """Independence, checked on the generator: the same header gives the same line i
    whatever the line count, apart from the free choices."""
    for seed in range(10):
        a = tasks.make_table(random.Random(seed), 30)
        b = next(q for q in (tasks.make_table(random.Random(s), 7) for s in range(100, 10**4))
                 if _header(q)[:2] == _header(a)[:2])
        la, lb = tasks.parse_lines(a.response)[:-1], tasks.parse_lines(b.response)[:-1]
        assert len(la) == 30 and len(lb) == 7
        assert [tasks.normalise_line(x) for x in la[:7]] == [tasks.normalise_line(x) for x in lb]


def test_v3_lengths_and_families_are_computed():
    stats = tasks.split_stats(tasks.heldout(1000, "v3"))
    assert stats["frac_over_128"] >= 0.30 and stats["frac_over_256"] >= 0.10
    fams = stats["families"]
    assert set(fams) == set(tasks.TASK_SETS["v3"]) and all(f["n"] == 250 for f in fams.values())
    assert abs(fams["walk"]["mean_tokens"] - fams["table"]["mean_tokens"]) < 20
    assert fams["walk"]["min_tokens"] == fams["table"]["min_tokens"] == 11 * 2 + 3
    assert fams["walk"]["max_tokens"] == fams["table"]["max_tokens"] == 11 * 34 + 3
    # Every prompt fits the trainer's one prompt length, every answer its largest bucket.
    cfg = train.v3_config()
    assert stats["max_prompt_tokens"] <= cfg.buckets[0][0]
    for p in tasks.heldout(200, "v3"):
        train.smallest_bucket(cfg.buckets, p)
    assert cfg.name == "tiny-llada-v3" and train.v3_config("dream").name == "tiny-dream-v3"


def test_v3_words_came_after_every_earlier_id():
    vocab = tok.vocabulary()
    assert vocab[-7:] == ("walk", "from", "by", "table", "of", "lines", "to")
    assert vocab.index("each") == len(vocab) - 8  # v2's last word stays where it was
    for p in tasks.heldout(40, "v3"):
        assert tok.decode_ids(tok.encode(p.response)) == " ".join(
            tok.split_words(p.response))


@pytest.mark.parametrize("family", tasks.HEADER_FAMILIES)
def test_a_wrong_sign_or_a_missing_last_line_is_refused(family):
    p = tasks.MAKERS[family](random.Random(4), 6)
    lines = tasks.parse_lines(p.response)
    t = lines[2].split()
    t[3] = "-" if t[3] == "+" else "+"
    assert not tasks.check(p, " \n ".join(lines[:2] + [" ".join(t)] + lines[3:]))
    assert not tasks.check(p, " \n ".join(lines[:-2] + lines[-1:]))
    assert tasks.check(p, p.response)


def test_residual_reading_rules_of_walk_and_table():
    """The residual table's rule for what the next line reads, checked against the
    problems: a walk line's result (both copies) starts the next line and its sign is
    the next line's unless that line turns; a table line is read by nothing."""
    from asynclane_jax.testbed import residual

    for p in tasks.heldout(80, "v3"):
        lines = _working(p)
        if p.family == "table":
            assert all(residual.read_slots("table", t) == set() for t in lines)
            continue
        if p.family != "walk":
            continue
        for t, nxt in zip(lines, lines[1:]):
            slots = residual.read_slots("walk", t)
            assert slots == {3, 6, 9} and t[6] == t[9] == nxt[2]
            step = int(t[4])
            keeps = 0 <= (int(t[6]) + step if t[3] == "+" else int(t[6]) - step) <= 9
            assert (nxt[3] == t[3]) == keeps


@pytest.mark.parametrize("family", ["walk", "table"])
def test_v4_is_v3_with_the_labels_counting_down(family):
    """Drawn from the same random state, a v4 problem has the v3 problem's lines (free
    choices included) and answer; only the labels, now n .. (1), and the header's span
    differ. So the last working line is always (1), and the stop needs no comparison."""
    from asynclane_jax.testbed import residual

    for seed in range(30):
        up = tasks.MAKERS[family](random.Random(seed))
        down = tasks.MAKERS[f"{family}-down"](random.Random(seed))
        n = len(up.lines) - 1
        assert down.family == f"{family}-down" and down.answer == up.answer
        assert down.prompt == up.prompt.replace(f"(1) to ({n})", f"({n}) to (1)")
        lu, ld = _working(up), _working(down)
        assert [t[0] for t in ld] == [f"({n - i})" for i in range(n)]
        assert [t[1:] for t in ld] == [t[1:] for t in lu]
        assert tasks.parse_lines(down.response)[-1] == tasks.parse_lines(up.response)[-1]
        assert tasks.check(down, down.response) and not tasks.check(down, up.response)
        assert all(residual.read_slots(down.family, t) == residual.read_slots(family, t)
                   for t in ld)
    stats = tasks.split_stats(tasks.heldout(1000, "v4"))
    assert stats["frac_over_128"] >= 0.30 and stats["frac_over_256"] >= 0.10
    assert set(stats["families"]) == {"math", "code", "walk-down", "table-down"}
    cfg = train.v4_config("dream")
    assert cfg.name == "tiny-dream-v4" and cfg.task_set == "v4"
    assert stats["max_prompt_tokens"] <= cfg.buckets[0][0]
    # The held-out splits are the same problems, so v3 and v4 results compare row by row.
    for a, b in zip(tasks.heldout(400, "v3"), tasks.heldout(400, "v4")):
        assert b.family == (a.family if a.family in ("math", "code") else f"{a.family}-down")
        assert b.answer == a.answer and len(b.lines) == len(a.lines)
        assert (a.prompt == b.prompt) == (a.family in ("math", "code"))


@pytest.mark.parametrize("task_set", list(tasks.TASK_SETS))
def test_the_default_generation_length_holds_every_heldout_answer(task_set):
    """`default_gen_length` (what eval, the D2F and Early-Bird trainings use when no
    length is given) leaves room for the end-of-text after the longest of the first 1000
    held-out answers, and is not longer than needed (the first task set's answers fit
    256; the long sets' need more)."""
    longest = max(tasks.answer_tokens(p) for p in tasks.heldout(1000, task_set))
    g = tasks.default_gen_length(task_set)
    assert longest < g
    assert (g == 256) == (task_set == tasks.DEFAULT_TASK_SET)
    if g == 512:
        assert longest >= 256
    with pytest.raises(ValueError, match="task set"):
        tasks.default_gen_length("v9")
