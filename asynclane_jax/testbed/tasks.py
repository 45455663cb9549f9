"""Synthetic reasoning tasks with exact answers and newline-separated working lines.

Two families, both built so that each line is a tiny lookup (a one-digit operand applied
to a value in 0..9, or a copy) and the difficulty comes from the chain of dependent lines
— which is also where parallel decoding goes wrong:

  math  a word problem; one working line per event, then the answer line.
        prompt:   ann has 7 coins . (1) finds 2 (2) loses 5 (3) buys 4 (4) eats 1 .
                  how many coins ?
        response: (1) 7 + 2 = 9 \\n (2) 9 - 5 = 4 \\n (3) 4 + 4 = 8 \\n (4) 8 - 1 = 7 \\n
                  answer : 7

  code  a two-variable program and its execution trace (the whole state on every line).
        prompt:   x = 4 y = 7 (1) x = y + 2 (2) y = x - 5 (3) x = x - 1 print y
        response: (0) x = 4 y = 7 \\n (1) 7 + 2 = 9 x = 9 y = 7 \\n
                  (2) 9 - 5 = 4 x = 9 y = 4 \\n (3) 9 - 1 = 8 x = 8 y = 4 \\n
                  answer : 4

Every word, number (0..99), label "(k)" and the newline is one token (see tokenizer.py;
the names, items, verbs and variables are in words.py, which both modules read).
Each family has a fixed number of events (MATH_STEPS, CODE_STEPS), so all prompts of a
family have the same length and the statement a working line reads sits at a fixed
distance from that line: fetching it is a positional copy rather than a search by
label, and what remains to learn is the chain itself. Responses are 31 (math) and 50
(code) tokens; the rest of a 128..512-token canvas is end-of-text padding.

Task sets. The first shipped models were trained on the set "v1" (math, code). The set
"v2" adds two long families of one surface form, 2 to 34 working lines each (25 to 377
response tokens), so that a 512-token canvas holds the answer and is not mostly padding:

  chain  chained control: every line reads the previous line's result.
        prompt:   start 7 : (1) + 2 (2) - 5 (3) + 4 . end ?
        response: (1) then 7 + 2 = 9 , so 9 \n (2) next 9 - 5 = 4 , thus 4 \n
                  (3) also 4 + 4 = 8 , so 8 \n answer : 8

  list  independent lines: every line reads only the prompt (its own statement).
        prompt:   solve each : (1) 3 + 2 (2) 9 - 5 (3) 1 + 4 .
        response: (1) next 3 + 2 = 5 , hence 5 \n (2) then 9 - 5 = 4 , so 4 \n
                  (3) then 1 + 4 = 5 , thus 5 \n answer : 5

Each line opens with a connective (then / next / also) and restates its result after a
consequence word (so / thus / hence), each drawn uniformly: these are free-choice
positions, graded right whichever member of the set is written (`normalise_line`), so a
model's confidence there is about one third by nature. chain and list are graded
strictly: every working line right (free choices aside) and the answer line right; math
and code by their answer line, as before. The prompt length grows with the number of
lines, so a line finds its statement by its label, not at a fixed distance.

The set "v3" keeps math and code and replaces chain and list with two families of the
same line form whose prompt is a fixed-length header, so no line has to find its own
statement by label in a prompt that grows with the line count (what the tiny models
failed to learn in v2):

  walk   chained control: every line moves the previous line's result by the header's
        step, on in the previous line's direction (up at first) and turning where it
        would leave 0..9 (`walk_step`).
        prompt:   walk from 7 by 3 : lines (1) to (4) .
        response: (1) then 7 - 3 = 4 , so 4 \n (2) next 4 - 3 = 1 , thus 1 \n
                  (3) also 1 + 3 = 4 , so 4 \n (4) then 4 + 3 = 7 , hence 7 \n answer : 7

  table  independent lines: line i adds the header's operand to the digit i - 1 places
        after the start (mod 10, `table_row`); it reads the header and its own label only.
        prompt:   table of 3 from 8 : lines (1) to (4) .
        response: (1) then 8 + 3 = 11 , so 11 \n (2) also 9 + 3 = 12 , hence 12 \n
                  (3) next 0 + 3 = 3 , so 3 \n (4) then 1 + 3 = 4 , thus 4 \n answer : 4

Both have 2 to 34 lines, the free-choice words of v2 and its strict grading. Their
prompts are the header's parameters and nothing else (10 x 5 x 33 = 1,650 of each), so
the training stream, which skips held-out prompts, never sees a held-out (start, step,
line count) triple.

The set "v4" is v3 with the labels of walk and table counting down to (1) (families
walk-down and table-down): the lines, their values and the answer are those of the
same v3 problem, and only the labels and the header's span change. The last line is
always (1), so a model knows where to stop from the line it is on, not by matching its
label with the header (what tiny-llada-v3 failed to learn: it seldom stopped):

  walk-down  prompt:   walk from 7 by 3 : lines (4) to (1) .
             response: (4) then 7 - 3 = 4 , so 4 \n (3) next 4 - 3 = 1 , thus 1 \n
                       (2) also 1 + 3 = 4 , so 4 \n (1) then 4 + 3 = 7 , hence 7 \n
                       answer : 7

Splits are fixed: the held-out split is drawn from its own seed, and the training stream
skips any problem whose prompt occurs among the first HELDOUT_POOL held-out problems of
the same task set.
"""

from __future__ import annotations

import dataclasses
import functools
import random

from asynclane_jax.testbed import tokenizer
from asynclane_jax.testbed.words import (
    CONNECTIVES,
    CONSEQUENCES,
    GAIN_VERBS,
    ITEMS,
    LOSS_VERBS,
    NAMES,
    VARIABLES,
    label,
)

TASK_SETS = {"v1": ("math", "code"), "v2": ("math", "code", "chain", "list"),
             "v3": ("math", "code", "walk", "table"),
             "v4": ("math", "code", "walk-down", "table-down")}
DEFAULT_TASK_SET = "v1"  # what the first shipped models (tiny-llada, tiny-dream) know
FAMILIES = TASK_SETS[DEFAULT_TASK_SET]
LONG_FAMILIES = ("chain", "list")  # v2: statements labelled in the prompt
# v3 / v4: a fixed-length header says everything (v4: labels count down to (1)).
HEADER_FAMILIES = ("walk", "table", "walk-down", "table-down")
CHAINED_HEADER = ("walk", "walk-down")  # of them, those whose lines read the line before
# Families of 2..LONG_STEPS working lines of one 11-token form, graded on every line.
LINE_FAMILIES = LONG_FAMILIES + HEADER_FAMILIES
MAX_VALUE = 9  # every intermediate value stays in 0..MAX_VALUE
MAX_OPERAND = 5
MAX_STEPS = 8  # labels (0)..(MAX_STEPS) exist in the vocabulary
MATH_STEPS = (4, 4)  # inclusive range of events per math problem
CODE_STEPS = (3, 3)  # inclusive range of statements per program
LONG_STEPS = (2, 34)  # inclusive range of working lines of chain and list
# Answer-length buckets (response tokens before end-of-text) that results are split by.
LENGTH_BUCKETS = (("<=64", 0, 64), ("65-128", 65, 128), ("129-256", 129, 256),
                  (">256", 257, 10**9))

TRAIN_SEED = 20240601
HELDOUT_SEED = 777
HELDOUT_POOL = 2000


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: whitespace-separated token strings, newline tokens as "\\n"."""

    family: str
    prompt: str  # the problem text (without chat markers)
    response: str  # working lines and the answer line, newline-separated
    answer: int

    @property
    def lines(self) -> list[str]:
        return [ln.strip() for ln in self.response.split("\n")]


def _step(rng: random.Random, value: int) -> tuple[str, int]:
    """A random (+/-, operand) keeping value + op in [0, MAX_VALUE]."""
    options = [("+", c) for c in range(1, MAX_OPERAND + 1) if value + c <= MAX_VALUE]
    options += [("-", c) for c in range(1, MAX_OPERAND + 1) if value - c >= 0]
    # Pick the sign first so that neither dominates near the ends of the range.
    signs = sorted({s for s, _ in options})
    sign = rng.choice(signs)
    c = rng.choice([c for s, c in options if s == sign])
    return sign, c


def _apply(value: int, sign: str, c: int) -> int:
    return value + c if sign == "+" else value - c


def make_math(rng: random.Random, n_steps: int | None = None) -> Problem:
    n = n_steps or rng.randint(*MATH_STEPS)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(0, MAX_VALUE)
    prompt = [f"{name} has {value} {item} ."]
    lines = []
    for i in range(1, n + 1):
        sign, c = _step(rng, value)
        verb = rng.choice(GAIN_VERBS if sign == "+" else LOSS_VERBS)
        new = _apply(value, sign, c)
        prompt.append(f"{label(i)} {verb} {c}")
        lines.append(f"{label(i)} {value} {sign} {c} = {new}")
        value = new
    prompt.append(f". how many {item} ?")
    lines.append(f"answer : {value}")
    return Problem("math", " ".join(prompt), " \n ".join(lines), value)


def make_code(rng: random.Random, n_steps: int | None = None) -> Problem:
    n = n_steps or rng.randint(*CODE_STEPS)
    state = {v: rng.randint(0, MAX_VALUE) for v in VARIABLES}
    prompt = [f"{v} = {state[v]}" for v in VARIABLES]

    def show():
        return " ".join(f"{v} = {state[v]}" for v in VARIABLES)

    lines = [f"{label(0)} {show()}"]
    for i in range(1, n + 1):
        target, source = rng.choice(VARIABLES), rng.choice(VARIABLES)
        sign, c = _step(rng, state[source])
        new = _apply(state[source], sign, c)
        prompt.append(f"{label(i)} {target} = {source} {sign} {c}")
        lines.append(f"{label(i)} {state[source]} {sign} {c} = {new} ")
        state[target] = new
        lines[-1] += show()
    shown = rng.choice(VARIABLES)
    prompt.append(f"print {shown}")
    lines.append(f"answer : {state[shown]}")
    return Problem("code", " ".join(prompt), " \n ".join(lines), state[shown])


def _long_line(rng: random.Random, i: int, value: int, sign: str, c: int) -> str:
    """One working line of chain / list: (i) CONNECTIVE v +/- c = r , CONSEQUENCE r
    (i is the label's number)."""
    new = _apply(value, sign, c)
    return (f"{label(i)} {rng.choice(CONNECTIVES)} {value} {sign} {c} = {new} , "
            f"{rng.choice(CONSEQUENCES)} {new}")


def _make_long(family: str, rng: random.Random, n_steps: int | None = None) -> Problem:
    """chain or list: one surface form; only where a line's starting value comes from
    differs (the previous line's result, or its own statement in the prompt)."""
    chained = family == "chain"
    n = n_steps or rng.randint(*LONG_STEPS)
    value = rng.randint(0, MAX_VALUE) if chained else 0
    prompt, lines = [f"start {value} :" if chained else "solve each :"], []
    for i in range(1, n + 1):
        if not chained:
            value = rng.randint(0, MAX_VALUE)
        sign, c = _step(rng, value)
        prompt.append(f"{label(i)} {sign} {c}" if chained else f"{label(i)} {value} {sign} {c}")
        lines.append(_long_line(rng, i, value, sign, c))
        value = _apply(value, sign, c)
    prompt.append(". end ?" if chained else ".")
    lines.append(f"answer : {value}")
    return Problem(family, " ".join(prompt), " \n ".join(lines), value)


make_chain = functools.partial(_make_long, "chain")
make_list = functools.partial(_make_long, "list")


def _span_of_lines(n: int, down: bool = False) -> str:
    """The header's line count, written with the first and last lines' own labels, so
    that a line knows it is the last one by matching its label, not by comparing it
    with a number. Counting down (v4), the last line is always (1)."""
    return f"lines {label(n)} to (1)" if down else f"lines (1) to {label(n)}"


def _line_label(i: int, n: int, down: bool) -> int:
    """The label number of working line i (1-based) of n: i, or n - i + 1 counting down."""
    return n - i + 1 if down else i


def walk_step(value: int, step: int, sign: str = "+") -> tuple[str, int]:
    """One move of walk: on in the previous move's direction (`sign`) while that stays
    within 0..MAX_VALUE, else back the other way (a walk that reflects at both ends)."""
    turn = {"+": "-", "-": "+"}[sign]
    for s in (sign, turn):
        new = _apply(value, s, step)
        if 0 <= new <= MAX_VALUE:
            return s, new
    raise ValueError(f"step {step} from {value}: leaves 0..{MAX_VALUE} both ways")


def make_walk(rng: random.Random, n_steps: int | None = None, down: bool = False) -> Problem:
    """walk (chained): every line moves the previous line's result by the header's step,
    in the previous line's direction (up at first), turning where it would leave
    0..MAX_VALUE; so a line reads the line before it (its result and its sign).

    prompt:   walk from 7 by 3 : lines (1) to (4) .
    response: (1) then 7 - 3 = 4 , so 4 \n
              (2) next 4 - 3 = 1 , thus 1 \n (3) also 1 + 3 = 4 , so 4 \n
              (4) then 4 + 3 = 7 , hence 7 \n answer : 7

    With down=True (walk-down, v4) the same problem has its labels counting down to
    (1): `lines (4) to (1)`, and the lines are labelled (4), (3), (2), (1).
    """
    n = n_steps or rng.randint(*LONG_STEPS)
    value, step = rng.randint(0, MAX_VALUE), rng.randint(1, MAX_OPERAND)
    prompt = f"walk from {value} by {step} : {_span_of_lines(n, down)} ."
    lines, sign = [], "+"
    for i in range(1, n + 1):
        sign, new = walk_step(value, step, sign)
        lines.append(_long_line(rng, _line_label(i, n, down), value, sign, step))
        value = new
    lines.append(f"answer : {value}")
    return Problem("walk-down" if down else "walk", prompt, " \n ".join(lines), value)


def table_row(start: int, i: int) -> int:
    """The left operand of table's line i: the digits counted up from `start`, mod 10."""
    return (start + i - 1) % 10


def make_table(rng: random.Random, n_steps: int | None = None, down: bool = False) -> Problem:
    """table (independent): line i adds the header's operand to table_row(start, i), so
    it reads only the header and its own label, never another line.

    prompt:   table of 3 from 8 : lines (1) to (4) .
    response: (1) then 8 + 3 = 11 , so 11 \n (2) also 9 + 3 = 12 , hence 12 \n
              (3) next 0 + 3 = 3 , so 3 \n (4) then 1 + 3 = 4 , thus 4 \n answer : 4

    With down=True (table-down, v4) the lines are the same and their labels count down
    to (1) (`lines (4) to (1)`): the line labelled L of n is line i = n - L + 1, so it
    still reads only the header (start, operand, n) and its own label.
    """
    n = n_steps or rng.randint(*LONG_STEPS)
    add, start = rng.randint(1, MAX_OPERAND), rng.randint(0, MAX_VALUE)
    prompt, lines = f"table of {add} from {start} : {_span_of_lines(n, down)} .", []
    for i in range(1, n + 1):
        lines.append(_long_line(rng, _line_label(i, n, down), table_row(start, i), "+", add))
    value = table_row(start, n) + add
    lines.append(f"answer : {value}")
    return Problem("table-down" if down else "table", prompt, " \n ".join(lines), value)


def _is_label(token: str) -> bool:
    return len(token) > 2 and token[0] == "(" and token[-1] == ")" and token[1:-1].isdigit()


def shuffle_statements(problem: Problem, rng: random.Random) -> Problem:
    """A chain / list problem whose prompt lists its labelled statements in a random
    order (the response, still in label order, and the answer are unchanged).

    A training augmentation: with the statements in order, the first lines' statements
    sit at offsets a model can find by position; shuffled, a line's statement can only
    be found by its label. Other families are returned as they are.
    """
    if problem.family not in LONG_FAMILIES:
        return problem
    words = problem.prompt.split(" ")
    starts = [i for i, w in enumerate(words) if _is_label(w)]
    end = words.index(".", starts[-1])
    pieces = [words[a:b] for a, b in zip(starts, starts[1:] + [end])]
    rng.shuffle(pieces)
    prompt = words[:starts[0]] + [w for piece in pieces for w in piece] + words[end:]
    return dataclasses.replace(problem, prompt=" ".join(prompt))


MAKERS = {"math": make_math, "code": make_code, "chain": make_chain, "list": make_list,
          "walk": make_walk, "table": make_table,
          "walk-down": functools.partial(make_walk, down=True),
          "table-down": functools.partial(make_table, down=True)}


def families_of(task_set: str) -> tuple[str, ...]:
    """The families of a named task set ("v1" .. "v4")."""
    try:
        return TASK_SETS[task_set]
    except KeyError:
        raise ValueError(f"task set {task_set!r}: expected one of "
                         f"{', '.join(TASK_SETS)}") from None


def default_gen_length(task_set: str) -> int:
    """The generation length a task set's answers need: 256 for the first task set's
    short answers, 512 for the sets with long answers (up to about 400 tokens)."""
    families_of(task_set)  # a known task set
    return 256 if task_set == DEFAULT_TASK_SET else 512


def recorded_task_set(config: dict) -> str:
    """The task set a converted folder's config.json (as a dict) says its model was
    trained on: the testbed trainer records it, and a D2F student's distillation
    config its problems'; other models (and the first shipped ones, trained before task
    sets existed) read as DEFAULT_TASK_SET."""
    testbed = config.get("testbed") or {}
    return ((testbed.get("train_config") or {}).get("task_set")
            or (config.get("distill") or {}).get("task_set") or DEFAULT_TASK_SET)


def model_task_set(path_or_name) -> str:
    """recorded_task_set of a shipped model name or converted folder."""
    import json

    from asynclane_jax import checkpoint

    folder = checkpoint.resolve(path_or_name)
    return recorded_task_set(json.loads((folder / checkpoint.CONFIG_FILE).read_text()))


def task_families(families) -> tuple[str, ...]:
    """The families of a task set given by name ("v2") or as a tuple of family names."""
    if isinstance(families, str):
        return families_of(families)
    families = tuple(families)
    unknown = [f for f in families if f not in MAKERS]
    if unknown or not families:
        raise ValueError(f"families {unknown or families}: expected some of "
                         f"{', '.join(MAKERS)}")
    return families


def make_problem(rng: random.Random, family: str | None = None) -> Problem:
    family = family or rng.choice(FAMILIES)
    return MAKERS[family](rng)


def heldout(n: int, families=FAMILIES) -> list[Problem]:
    """The first n held-out problems of a task set (its name or a tuple of families),
    families alternating (deterministic)."""
    families = task_families(families)
    rng = random.Random(HELDOUT_SEED)
    return [make_problem(rng, families[i % len(families)]) for i in range(n)]


@functools.lru_cache(maxsize=4)
def _heldout_prompts(families: tuple[str, ...]) -> frozenset[str]:
    return frozenset(p.prompt for p in heldout(HELDOUT_POOL, families))


def is_heldout(prompt: str, families=FAMILIES) -> bool:
    """Whether a prompt is one of the held-out problems of a task set."""
    return prompt in _heldout_prompts(task_families(families))


def check_family_weights(weights, families) -> tuple[float, ...]:
    """Relative weights of a task set's families (one per family, in its order, none
    negative, not all zero), as floats; ValueError otherwise."""
    families = task_families(families)
    weights = tuple(float(w) for w in weights)
    if len(weights) != len(families) or min(weights) < 0 or not sum(weights) > 0:
        raise ValueError(f"family weights {list(weights)}: expected {len(families)} weights "
                         f"(for {', '.join(families)}), none negative, not all zero")
    return weights


def problem_stream(seed: int = TRAIN_SEED, families=FAMILIES, weights=None):
    """An endless training stream that never yields a held-out prompt of its task set.

    weights None: a family is drawn uniformly and a held-out draw is skipped (so the
    families whose prompts the held-out split covers more of come a little less often;
    the shipped models were trained on this stream). `weights` (relative, one per family
    in the task set's order; check_family_weights): a family is drawn by weight and
    redrawn from until its problem is not held out, so the stream's mix is the weights'.
    """
    families = task_families(families)
    rng = random.Random(seed)
    excluded = _heldout_prompts(families)
    if weights is None:
        while True:
            p = make_problem(rng, rng.choice(families))
            if p.prompt not in excluded:
                yield p
    weights = check_family_weights(weights, families)
    while True:
        family = rng.choices(families, weights)[0]
        p = make_problem(rng, family)
        while p.prompt in excluded:
            p = make_problem(rng, family)
        yield p


def split(name: str, n: int, families=FAMILIES) -> list[Problem]:
    """n problems of a named split: "heldout" or "train" (the stream's first n)."""
    if name == "heldout":
        return heldout(n, families)
    if name == "train":
        stream = problem_stream(families=families)
        return [next(stream) for _ in range(n)]
    raise ValueError(f"split={name!r}: expected 'heldout' or 'train'")


# --------------------------------------------------------------------------- statistics

def answer_tokens(problem: Problem) -> int:
    """Response tokens of the reference answer (end-of-text excluded)."""
    return len(tokenizer.split_words(problem.response))


def length_bucket(n_tokens: int) -> str:
    """The LENGTH_BUCKETS name an answer of n_tokens falls in."""
    for name, lo, hi in LENGTH_BUCKETS:
        if lo <= n_tokens <= hi:
            return name
    raise ValueError(f"answer length {n_tokens}: not a token count")


def split_stats(problems: list[Problem], bin_width: int = 32) -> dict:
    """Answer-length and family statistics of a list of problems, as the model cards
    report them: per family the count, min / mean / max answer tokens and working lines;
    the share of answers above 128 and 256 tokens; counts per LENGTH_BUCKETS bucket; a
    histogram of answer tokens in bins of bin_width; the longest prompt (chat markers
    included)."""
    lengths = [answer_tokens(p) for p in problems]
    if not lengths:
        raise ValueError("no problems to describe")
    out: dict = {"n": len(problems),
                 "frac_over_128": sum(n > 128 for n in lengths) / len(lengths),
                 "frac_over_256": sum(n > 256 for n in lengths) / len(lengths),
                 "max_prompt_tokens": max(len(tokenizer.split_words(p.prompt)) + 2
                                          for p in problems),
                 "buckets": {name: sum(length_bucket(n) == name for n in lengths)
                             for name, _, _ in LENGTH_BUCKETS}}
    fams: dict = {}
    for p, n in zip(problems, lengths):
        fams.setdefault(p.family, []).append((n, len(p.lines) - 1))
    out["families"] = {
        f: {"n": len(v), "min_tokens": min(n for n, _ in v),
            "mean_tokens": round(sum(n for n, _ in v) / len(v), 1),
            "max_tokens": max(n for n, _ in v),
            "mean_lines": round(sum(k for _, k in v) / len(v), 2)}
        for f, v in fams.items()}
    top = max(lengths)
    out["histogram"] = {"bin_width": bin_width,
                        "counts": [sum(b * bin_width < n <= (b + 1) * bin_width
                                       for n in lengths)
                                   for b in range(top // bin_width + 1)]}
    return out


# --------------------------------------------------------------------------- checking

def response_text(generated: str | list[str]) -> str:
    """Normalises generated text (or token strings) to whitespace-joined tokens, cut at
    the first end-of-text marker."""
    if isinstance(generated, str):
        tokens = generated.replace("\n", " \n ").split(" ")
    else:
        tokens = list(generated)
    out = []
    for t in tokens:
        if t == tokenizer.EOS:
            break
        if t.strip() or t == "\n":
            out.append(t if t == "\n" else t.strip())
    return " ".join(out)


def parse_lines(text: str) -> list[str]:
    return [" ".join(ln.split()) for ln in text.split("\n") if ln.strip()]


_FREE = {**{w: "<connective>" for w in CONNECTIVES},
         **{w: "<consequence>" for w in CONSEQUENCES}}


def normalise_line(line: str) -> str:
    """A line with every free-choice word replaced by its set's name, so that any
    connective (then / next / also) and any consequence word (so / thus / hence) is as
    right as the reference's. The free words occur nowhere else, and the two sets have
    different names: a consequence word in a connective's place stays wrong."""
    return " ".join(_FREE.get(t, t) for t in line.split())


def _lines_of(generated) -> list[str]:
    if not isinstance(generated, str) and len(generated) and not isinstance(generated[0], str):
        generated = tokenizer.decode_ids(generated)
    return [normalise_line(ln) for ln in parse_lines(response_text(generated))]


def check(problem: Problem, generated) -> bool:
    """Whether a generated response is right.

    math and code: the last line of the response (before end-of-text) must read
    "answer : N" with N the problem's answer. chain, list, walk and table: every line
    must equal the reference's, free choices aside (`normalise_line`), and no line may
    be added.

    Args:
      problem: the Problem.
      generated: the generated text, a list of token strings, or a list of token ids of
        the testbed tokenizer.
    """
    lines = _lines_of(generated)
    if problem.family in LINE_FAMILIES:
        return lines == [normalise_line(ln) for ln in parse_lines(problem.response)]
    return bool(lines) and lines[-1] == f"answer : {problem.answer}"


def line_accuracy(problem: Problem, generated) -> tuple[int, int]:
    """(working lines exactly right, working lines in the reference), free choices
    aside; a line counts when it is right at its own position."""
    got = _lines_of(generated)
    ref = [normalise_line(ln) for ln in parse_lines(problem.response)]
    right = sum(1 for i, r in enumerate(ref) if i < len(got) and got[i] == r)
    return right, len(ref)
