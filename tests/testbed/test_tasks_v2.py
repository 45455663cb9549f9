"""The task set v2: long chained and independent families with free-choice words."""

from __future__ import annotations

import itertools
import json
import pathlib
import random

import numpy as np
import pytest

from asynclane_jax.testbed import tasks, train
from asynclane_jax.testbed import tokenizer as tok
from asynclane_jax.testbed.words import CONNECTIVES, CONSEQUENCES

MODELS = pathlib.Path(tasks.__file__).parent / "models"


def _problem(family: str, n_steps: int, seed: int = 0) -> tasks.Problem:
    return tasks.MAKERS[family](random.Random(seed), n_steps)


def _tokens(line: str) -> list[str]:
    return line.split()


@pytest.mark.parametrize("family", tasks.LINE_FAMILIES)
def test_every_free_choice_is_graded_right(family):
    p = _problem(family, 2)
    lines = tasks.parse_lines(p.response)
    # Positions 1 (connective) and 8 (consequence word) of each working line are free.
    choices = []
    for ln in lines[:-1]:
        t = _tokens(ln)
        assert t[1] in CONNECTIVES and t[8] in CONSEQUENCES
        choices.append([(c, s) for c in CONNECTIVES for s in CONSEQUENCES])
    for combo in itertools.product(*choices):
        new = []
        for ln, (c, s) in zip(lines[:-1], combo):
            t = _tokens(ln)
            t[1], t[8] = c, s
            new.append(" ".join(t))
        text = " \n ".join(new + lines[-1:])
        assert tasks.check(p, text), text
        assert tasks.line_accuracy(p, text) == (len(lines), len(lines))


@pytest.mark.parametrize("family", tasks.LINE_FAMILIES)
def test_wrong_values_and_wrong_words_are_refused(family):
    p = _problem(family, 5, seed=3)
    lines = tasks.parse_lines(p.response)
    assert tasks.check(p, p.response)
    rng = random.Random(1)
    for _ in range(20):
        i = rng.randrange(len(lines) - 1)
        t = _tokens(lines[i])
        pos = rng.choice([2, 4, 6, 9])  # operand, operand, result, restated result
        t[pos] = str((int(t[pos]) + 1 + rng.randrange(9)) % 10)
        bad = lines[:i] + [" ".join(t)] + lines[i + 1:]
        text = " \n ".join(bad)
        assert not tasks.check(p, text)
        assert tasks.line_accuracy(p, text) == (len(lines) - 1, len(lines))
    # A consequence word where a connective belongs is wrong, and so is the reverse.
    t = _tokens(lines[0])
    t[1], t[8] = CONSEQUENCES[0], CONNECTIVES[0]
    assert not tasks.check(p, " \n ".join([" ".join(t)] + lines[1:]))
    # A missing line, an added line and a wrong answer line are wrong.
    assert not tasks.check(p, " \n ".join(lines[1:]))
    assert not tasks.check(p, " \n ".join(lines[:-1] + lines[-2:]))
    wrong = f"answer : {(p.answer + 1) % 10}"
    assert not tasks.check(p, " \n ".join(lines[:-1] + [wrong]))
    # Text after end-of-text does not count.
    assert tasks.check(p, p.response + f" {tok.EOS} (9) junk")


def test_the_list_lines_read_only_the_prompt_and_the_chain_lines_the_line_before():
    for p in tasks.heldout(60, "v2"):
        if p.family not in tasks.LONG_FAMILIES:
            continue
        stated = p.prompt.split(":")[1].rstrip(" .?end").split()
        lines = [_tokens(ln) for ln in tasks.parse_lines(p.response)[:-1]]
        if p.family == "list":
            items = [stated[i:i + 4] for i in range(0, len(stated), 4)]
            for (lab, a, s, c), t in zip(items, lines):
                assert t[0] == lab and t[2:5] == [a, s, c]
                assert int(t[6]) == (int(a) + int(c) if s == "+" else int(a) - int(c))
        else:
            value = int(p.prompt.split()[1])
            items = [stated[i:i + 3] for i in range(0, len(stated), 3)]
            for (lab, s, c), t in zip(items, lines):
                assert t[0] == lab and t[2:5] == [str(value), s, c]
                value = int(t[6])
                assert t[9] == t[6]
        assert _tokens(tasks.parse_lines(p.response)[-1]) == ["answer", ":", str(p.answer)]


def test_held_out_lengths_meet_the_design():
    """The answer lengths the long budgets need, computed on the held-out split."""
    stats = tasks.split_stats(tasks.heldout(1000, "v2"))
    assert stats["frac_over_128"] >= 0.30
    assert stats["frac_over_256"] >= 0.10
    lengths = [tasks.answer_tokens(p) for p in tasks.heldout(1000, "v2")]
    assert min(lengths) <= 31 and 350 <= max(lengths) <= 400
    assert sum(stats["buckets"].values()) == stats["n"] == 1000
    assert sum(stats["histogram"]["counts"]) == 1000
    fams = stats["families"]
    assert set(fams) == set(tasks.TASK_SETS["v2"]) and all(f["n"] == 250 for f in fams.values())
    # The chained control and the independent family have comparable lengths.
    assert abs(fams["chain"]["mean_tokens"] - fams["list"]["mean_tokens"]) < 20
    # Every held-out problem fits the trainer's buckets and a 1024-token generation.
    cfg = train.v2_config()
    for p in tasks.heldout(400, "v2"):
        train.smallest_bucket(cfg.buckets, p)
    assert stats["max_prompt_tokens"] + 1024 <= cfg.max_seq_len


def test_length_buckets_and_stats_by_hand():
    problems = [_problem("list", k) for k in (2, 6, 12, 24, 34)]
    lengths = [tasks.answer_tokens(p) for p in problems]
    assert lengths == [11 * k + 3 for k in (2, 6, 12, 24, 34)]
    assert [tasks.length_bucket(n) for n in lengths] == [
        "<=64", "65-128", "129-256", ">256", ">256"]
    stats = tasks.split_stats(problems)
    assert stats["buckets"] == {"<=64": 1, "65-128": 1, "129-256": 1, ">256": 2}
    assert stats["frac_over_256"] == pytest.approx(0.4)
    with pytest.raises(ValueError):
        tasks.split_stats([])


def test_v1_split_and_vocabulary_unchanged():
    assert tasks.heldout(30) == tasks.heldout(30, "v1") == tasks.heldout(30, ("math", "code"))
    assert {p.family for p in tasks.heldout(30)} == {"math", "code"}
    # The first models' tokenizer keeps its ids: the vocabulary only grew at its end.
    shipped = json.loads((MODELS / "tiny-llada" / "tokenizer.json").read_text())
    vocab = shipped["model"]["vocab"]
    assert len(vocab) == tok.FIRST_VOCAB_SIZE
    assert all(tok.token_to_id()[t] == i for t, i in vocab.items())
    with pytest.raises(ValueError, match="task set"):
        tasks.heldout(3, "v9")
    with pytest.raises(ValueError, match="families"):
        tasks.heldout(3, ("math", "poetry"))


@pytest.mark.parametrize("task_set", ["v2", "v3", "v4"])
def test_the_training_stream_skips_held_out_prompts(task_set):
    held = {p.prompt for p in tasks.heldout(tasks.HELDOUT_POOL, task_set)}
    stream = tasks.problem_stream(families=task_set)
    drawn = [next(stream) for _ in range(400)]
    assert not held & {p.prompt for p in drawn}
    assert {p.family for p in drawn} == set(tasks.TASK_SETS[task_set])


def test_training_stream_and_buckets():
    stream = tasks.problem_stream(families="v2")
    drawn = [next(stream) for _ in range(400)]
    buckets = train.V2_BUCKETS
    bs = train.BucketedStream(iter(drawn), buckets)
    rng = np.random.default_rng(0)
    for _ in range(6):
        batch = bs.batch(rng)
        rows, n = batch["tokens"].shape
        index = [b[2] for b in buckets].index(rows)
        p_len, region = buckets[index][:2]
        assert n == p_len + region and batch["response"][:, p_len:].all()
        assert not batch["response"][:, :p_len].any()
        # Each row's response ends with end-of-text, and no row belongs to a smaller bucket.
        eos = tok.special_ids()["eos_token_id"]
        assert (batch["tokens"][:, -1] == eos).all()
    for p in drawn[:50]:
        i = train.smallest_bucket(buckets, p)
        n_resp = len(tok.split_words(p.response))
        assert n_resp < buckets[i][1] and (i == 0 or n_resp >= buckets[i - 1][1]
                                           or len(tok.prompt_ids(p.prompt)) > buckets[i - 1][0])
    with pytest.raises(ValueError, match="fits no length bucket"):
        train.smallest_bucket(((32, 64, 1, 1.0),), _problem("list", 30))


def test_bucket_policies_and_the_line_count_curriculum():
    """"fits": every bucket takes the stream's problems that fit it (short answers with
    long end-of-text tails too); the line-count curriculum rises to every length (its
    cap: test_the_line_count_curriculum_caps_the_long_families)."""
    buckets = train.V2_BUCKETS
    fits = train.BucketedStream(tasks.problem_stream(families="v2"), buckets, "fits")
    last = fits.take(len(buckets) - 1, 40)
    assert {"math", "code"} <= {p.family for p in last}  # short answers, 512-token region
    assert all(train.fits_bucket(buckets[0], p) for p in fits.take(0, 20))

    tc = train.v2_config("llada", lines_curriculum=(4, 0.2, 0.6))
    assert [train.max_lines_at(tc, x) for x in (0.0, 0.2, 0.4, 0.6, 1.0)] == [4, 4, 19, 34, 34]
    assert train.max_lines_at(train.v2_config("llada"), 0.0) == tasks.LONG_STEPS[1]
    with pytest.raises(ValueError, match="bucket policy 'best'"):
        train.BucketedStream(iter([]), buckets, "best")


@pytest.mark.parametrize("task_set", ["v2", "v3", "v4"])
def test_the_line_count_curriculum_caps_the_long_families(task_set):
    """Capped at 4 lines, the long families' longer problems are redrawn shorter (never
    a held-out prompt), only the first bucket can be filled, and lifting the cap opens
    every bucket again."""
    buckets = train.V2_BUCKETS if task_set == "v2" else train.V3_BUCKETS
    held = {p.prompt for p in tasks.heldout(tasks.HELDOUT_POOL, task_set)}
    capped = train.BucketedStream(tasks.problem_stream(families=task_set), buckets,
                                  families=task_set, seed=3)
    capped.max_lines = 4
    assert capped.feedable() == [True, False, False, False]
    drawn = capped.take(0, 64)
    long = [p for p in drawn if p.family in tasks.LINE_FAMILIES]
    assert {p.family for p in long} == set(tasks.TASK_SETS[task_set][2:])
    assert len(long) > 16 and max(len(p.lines) - 1 for p in long) <= 4
    assert not held & {p.prompt for p in drawn}
    rng = np.random.default_rng(0)
    assert all(capped.batch(rng)["tokens"].shape == (32, buckets[0][0] + 64)
               for _ in range(5))
    assert (capped.batch(rng)["tokens"][:, -1] == tok.special_ids()["eos_token_id"]).all()
    capped.max_lines = tasks.LONG_STEPS[1]
    assert all(capped.feedable())


def _statements(prompt: str) -> list[str]:
    words = prompt.split(" ")
    starts = [i for i, w in enumerate(words) if tasks._is_label(w)] + [words.index(".")]
    return [" ".join(words[a:b]) for a, b in zip(starts, starts[1:])]


def test_shuffled_statements_keep_the_problem_and_are_graded_the_same():
    """The augmentation permutes a chain / list prompt's labelled statements (every one
    kept whole, the header and the end unchanged); the response, the answer and so the
    grading stay; math and code come back as they are."""
    rng = random.Random(5)
    orders = set()
    for family in tasks.LONG_FAMILIES:
        for _ in range(20):
            p = tasks.MAKERS[family](rng, 6)
            q = tasks.shuffle_statements(p, rng)
            before, after = _statements(p.prompt), _statements(q.prompt)
            assert sorted(before) == sorted(after) and len(after) == 6
            assert q.prompt.split(" (")[0] == p.prompt.split(" (")[0]
            assert q.prompt.rsplit(" .", 1)[1] == p.prompt.rsplit(" .", 1)[1]
            assert (q.response, q.answer, q.family) == (p.response, p.answer, p.family)
            assert tasks.check(q, p.response + " <|endoftext|>")
            orders.add(tuple(s.split(" ")[0] for s in after))
    assert len(orders) > 30  # the orders really vary
    for family in ("math", "code"):
        p = tasks.MAKERS[family](rng)
        assert tasks.shuffle_statements(p, rng) is p


def test_bucketed_stream_shuffles_at_its_rate():
    """shuffle=P: about a share P of the chain / list problems a bucket takes come with
    their statements out of order; none is a held-out prompt; 0 leaves every one."""
    def share(p):
        bs = train.BucketedStream(tasks.problem_stream(families="v2"), train.V2_BUCKETS,
                                  "fits", seed=1, shuffle=p)
        long = [q for q in bs.take(len(train.V2_BUCKETS) - 1, 200)
                if q.family in tasks.LONG_FAMILIES and len(q.lines) > 8]
        held = {h.prompt for h in tasks.heldout(tasks.HELDOUT_POOL, "v2")}
        assert not held & {q.prompt for q in long}
        labels = [[s.split(" ")[0] for s in _statements(q.prompt)] for q in long]
        return np.mean([lab != sorted(lab, key=lambda w: int(w[1:-1])) for lab in labels])

    assert share(0.0) == 0.0
    assert 0.35 < share(0.5) < 0.65
    assert share(1.0) == 1.0
    with pytest.raises(ValueError, match="shuffle probability 1.5"):
        train.BucketedStream(iter([]), train.V2_BUCKETS, shuffle=1.5)


def test_the_lookup_probe_masks_from_the_line_and_grades_it():
    """Each probe row shows the prompt and the lines before the probed one and masks the
    rest; an oracle (the reference's tokens as logits) scores 100% everywhere, free
    choices swapped for other members still count, and a model that predicts the mask
    scores 0."""
    from asynclane_jax.testbed import lookup

    problems = [p for p in tasks.heldout(40, "v2") if p.family in tasks.LONG_FAMILIES][:8]
    tokens, key_mask, meta = lookup.probe_rows(problems, per_problem=3)
    ids = tok.special_ids()
    assert len(meta) == sum(min(3, len(p.lines) - 1) for p in problems)
    lines = [tok.encode(ln) for p in problems for ln in p.lines[:-1]]
    for row, (family, index, positions, target) in zip(tokens, meta):
        assert family in tasks.LONG_FAMILIES and list(target) in lines
        assert positions[0] == lookup.PROMPT_BUCKET + 11 * (index - 1)
        assert (row[positions[0]:] == ids["mask_token_id"]).all()
        assert (row[lookup.PROMPT_BUCKET:positions[0]] != ids["mask_token_id"]).all()
    full = {}
    for p in problems:
        prompt = tok.prompt_ids(p.prompt)
        full[p.prompt] = np.concatenate([np.zeros(lookup.PROMPT_BUCKET - len(prompt), int),
                                         prompt, tok.encode(p.response)])
    vocab = tok.vocab_size()
    swap = {tok.token_to_id()[CONNECTIVES[0]]: tok.token_to_id()[CONNECTIVES[1]]}

    def oracle(t, key_mask=None):
        # The reference is recoverable from the unmasked prompt of each row.
        out = np.zeros(t.shape + (vocab,), np.float32)
        for i, row in enumerate(np.asarray(t)):
            prompt_part = tuple(row[:lookup.PROMPT_BUCKET])
            ref = next(v for v in full.values() if tuple(v[:lookup.PROMPT_BUCKET]) == prompt_part)
            ref = np.array([swap.get(int(x), int(x)) for x in ref])
            out[i, np.arange(len(ref)), ref] = 1.0
        return out

    got = lookup.probe(oracle, problems, per_problem=3, jit=False)
    assert all(v["lookup"] == v["result"] == v["line"] == 1.0
               for by in got.values() for v in by.values())
    blank = lookup.probe(lambda t, key_mask=None: np.eye(vocab)[np.asarray(t)], problems, 3,
                         jit=False)
    assert all(v["lookup"] == v["line"] == 0.0 for by in blank.values() for v in by.values())
