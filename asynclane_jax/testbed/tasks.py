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

Splits are fixed: the held-out split is drawn from its own seed, and the training stream
skips any problem whose prompt occurs among the first HELDOUT_POOL held-out problems.
"""

from __future__ import annotations

import dataclasses
import functools
import random

from asynclane_jax.testbed import tokenizer
from asynclane_jax.testbed.words import GAIN_VERBS, ITEMS, LOSS_VERBS, NAMES, VARIABLES, label

FAMILIES = ("math", "code")
MAX_VALUE = 9  # every intermediate value stays in 0..MAX_VALUE
MAX_OPERAND = 5
MAX_STEPS = 8  # labels (0)..(MAX_STEPS) exist in the vocabulary
MATH_STEPS = (4, 4)  # inclusive range of events per math problem
CODE_STEPS = (3, 3)  # inclusive range of statements per program

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


MAKERS = {"math": make_math, "code": make_code}


def make_problem(rng: random.Random, family: str | None = None) -> Problem:
    family = family or rng.choice(FAMILIES)
    return MAKERS[family](rng)


def heldout(n: int, families: tuple[str, ...] = FAMILIES) -> list[Problem]:
    """The first n held-out problems, families alternating (deterministic)."""
    rng = random.Random(HELDOUT_SEED)
    return [make_problem(rng, families[i % len(families)]) for i in range(n)]


@functools.lru_cache(maxsize=1)
def _heldout_prompts() -> frozenset[str]:
    return frozenset(p.prompt for p in heldout(HELDOUT_POOL))


def problem_stream(seed: int = TRAIN_SEED, families: tuple[str, ...] = FAMILIES):
    """An endless training stream that never yields a held-out prompt."""
    rng = random.Random(seed)
    excluded = _heldout_prompts()
    while True:
        p = make_problem(rng, rng.choice(families))
        if p.prompt not in excluded:
            yield p


def split(name: str, n: int) -> list[Problem]:
    """n problems of a named split: "heldout" or "train" (the stream's first n)."""
    if name == "heldout":
        return heldout(n)
    if name == "train":
        stream = problem_stream()
        return [next(stream) for _ in range(n)]
    raise ValueError(f"split={name!r}: expected 'heldout' or 'train'")


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


def check(problem: Problem, generated) -> bool:
    """Exact match of the final answer: the last line of the response (before
    end-of-text) must read "answer : N" with N the problem's answer.

    Args:
      problem: the Problem.
      generated: the generated text, a list of token strings, or a list of token ids of
        the testbed tokenizer.
    """
    if not isinstance(generated, str) and len(generated) and not isinstance(generated[0], str):
        generated = tokenizer.decode_ids(generated)
    lines = parse_lines(response_text(generated))
    return bool(lines) and lines[-1] == f"answer : {problem.answer}"


def line_accuracy(problem: Problem, generated) -> tuple[int, int]:
    """(working lines exactly right, working lines in the reference)."""
    if not isinstance(generated, str) and len(generated) and not isinstance(generated[0], str):
        generated = tokenizer.decode_ids(generated)
    got = parse_lines(response_text(generated))
    ref = parse_lines(problem.response)
    right = sum(1 for i, r in enumerate(ref) if i < len(got) and got[i] == r)
    return right, len(ref)
