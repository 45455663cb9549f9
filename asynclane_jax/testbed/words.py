"""The words the testbed's tasks are written in: names, items, verbs, variables and step
labels. Both sides use them: tasks.py writes problems with them and tokenizer.py gives
each one a token, so they live here, below both (tokenizer.py does not import tasks.py).
"""

from __future__ import annotations

NAMES = ("ann", "bob", "eve", "sam", "kim", "joe", "amy", "tom")
ITEMS = ("apples", "coins", "cards", "books", "pens", "shells")
GAIN_VERBS = ("gets", "finds", "buys", "wins")
LOSS_VERBS = ("loses", "gives", "eats", "sells")
VARIABLES = ("x", "y")


def label(i: int) -> str:
    """The step label "(i)"."""
    return f"({i})"
