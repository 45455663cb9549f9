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

# Free-choice words of the long families (chain, list): each working line opens with a
# connective and restates its result after a consequence word, each drawn uniformly from
# its set, and any member of the set is graded right. Their confidence is low by nature.
CONNECTIVES = ("then", "next", "also")
CONSEQUENCES = ("so", "thus", "hence")
LONG_WORDS = ("start", "end", "solve", "each")  # prompt words of chain and list
WALK_TABLE_WORDS = ("walk", "from", "by", "table", "of", "lines", "to")  # of walk and table
MAX_LABEL = 40  # labels (0)..(MAX_LABEL) are in the vocabulary


def label(i: int) -> str:
    """The step label "(i)"."""
    return f"({i})"
