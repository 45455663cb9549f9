"""Measured figures live in the results files only (experiments/results/).

Docstrings and command-line help describe behaviour and name the results file that
holds the numbers; a figure copied into them drifts from the file it came from. This
test parses every module of `asynclane_jax/` and `checkpoints_convert/` with `ast` and
fails, naming file:line and the text, when a docstring (module, class, function) or an
argparse `help=` / `description=` / `epilog=` string holds a measured figure:

* a ratio: a number followed by `x` or `×` (`2.50x`, `0.75x`; `2x2` and `9 x` are not);
* a percentage: a number followed by `%` (`42.5%`, `12 %`; argparse's `95%%` too), or
  an accuracy gap in points (`3.5 points`);
* a speed or a duration per unit: a number followed by `tok/s`, `tokens/s`,
  `tokens per second`, `it/s`, or `ms`/`s` `per` something;
* a measured memory amount with a decimal: `5.43 GiB`, `14.2 MB`.

`%` with no number before it (`%d`, `%(default)s`) is a format, not a figure. The
sampler `--help` texts are built from the samplers' docstrings
(`decoding/registry.py`), so the docstring rule covers them. Nothing is allow-listed:
write the behaviour and link to the results file instead.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("asynclane_jax", "checkpoints_convert")

_NUM = r"(?<![\w.])\d+(?:[.,]\d+)*"
FIGURE = re.compile(
    rf"{_NUM}[x×](?![\w-])"                                       # ratio: 2.50x
    rf"|{_NUM}\s?%(?![(\w])"                                     # percentage: 42.5%
    rf"|{_NUM}\s?(?:tok/s|tokens?/s|tokens? per second|it/s)"    # speed
    rf"|{_NUM}\s?(?:ms|s|seconds?) per\b"                        # time per unit
    rf"|{_NUM}\s?(?:percentage )?points?\b"                      # accuracy gap
    rf"|(?<![\w.])\d+\.\d+\s?(?:[KMGT]i?B)\b"                    # measured memory
)
HELP_KEYWORDS = ("help", "description", "epilog")


def _modules():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _strings(node: ast.AST):
    """Every string constant inside an expression (f-string parts, `+` and implicit
    concatenations alike), with its line."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.lineno, sub.value


def _texts(tree: ast.Module):
    """(line, kind, text) of each docstring and each help/description/epilog string
    (a module-level constant named there, `description=DESCRIPTION`, is read too)."""
    constants = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield body[0].value.lineno, "docstring", body[0].value.value
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in HELP_KEYWORDS:
                    value = kw.value
                    if isinstance(value, ast.Name) and value.id in constants:
                        value = constants[value.id]
                    for line, text in _strings(value):
                        yield line, f"{kw.arg}=", text


def figures_in(path: pathlib.Path) -> list[str]:
    """'file:line: kind holds "figure" in: ...' for each measured figure in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    found = []
    for line, kind, text in _texts(tree):
        for m in FIGURE.finditer(text):
            # The line of the figure itself: docstrings start at their opening quotes.
            at = line + text.count("\n", 0, m.start())
            lo = text.rfind("\n", 0, m.start()) + 1
            hi = text.find("\n", m.end())
            context = text[lo:hi if hi >= 0 else len(text)].strip()
            found.append(f"{rel}:{at}: {kind} holds {m.group(0)!r} in: {context}")
    return found


@pytest.mark.parametrize(
    "text",
    ["2.50x faster", "0.75x", "3.5 points short", "42.5%", "12 %", "40%% of answers",
     "1234 tokens/s", "1,234 tok/s", "2.5 ms per call", "1.25 GiB", "3.75 GiB peak"])
def test_pattern_catches_figures(text):
    assert FIGURE.search(text), text


@pytest.mark.parametrize(
    "text",
    ["%d rows", "%(default)s", "[b, G] int32", "0x1F", "a 2x2 grid", "v4b", "8-bit",
     "bf16", "tile 128x128", "a 16 GiB chip", "x = 3", "7 + 2 = 9 x = 9", "10 x 5 x 33",
     "step 100", "10 seconds to wait"])
def test_pattern_leaves_formats_and_facts(text):
    assert not FIGURE.search(text), text


def test_no_measured_figures_in_docstrings_or_help():
    found = [hit for path in _modules() for hit in figures_in(path)]
    assert not found, (
        "measured figures belong in experiments/results/ only; describe the behaviour "
        "and name the results file instead:\n" + "\n".join(found))
