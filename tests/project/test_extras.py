"""The README's install line (`pip install -e ".[test]"`) installs every package a test
would otherwise skip for: each module a test imports with `pytest.importorskip` comes
from a distribution the `test` extra requires, directly or through the extras it names."""

import ast
import importlib.metadata
import pathlib
import re
import sys

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Skips that are not for a missing extra: tomli stands in for tomllib on Python 3.10.
NOT_AN_EXTRA = {"tomli"}


def _extras() -> dict[str, list[Requirement]]:
    if sys.version_info < (3, 11):
        pytest.skip("reads pyproject.toml with tomllib")
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["name"] == "asynclane-jax"
    return {name: [Requirement(r) for r in reqs]
            for name, reqs in data["project"]["optional-dependencies"].items()}


def _test_extra_distributions() -> set[str]:
    """Distribution names the test extra requires, the extras it names expanded."""
    extras, seen, todo, names = _extras(), set(), ["test"], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in extras[extra]:
            if req.name == "asynclane-jax":
                todo.extend(req.extras)
            else:
                names.add(req.name.lower())
                if req.name == "jax" and "tpu" in req.extras:
                    names.add("libtpu")  # what jax[tpu] brings
    return names


def _importorskip_modules() -> set[str]:
    modules = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "importorskip" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                modules.add(node.args[0].value.split(".")[0])
    return modules


def test_the_test_extra_names_the_other_extras():
    names = _test_extra_distributions()
    for extra in ("tpu", "eval", "serve"):
        for req in _extras()[extra]:
            assert req.name.lower() in names, (extra, req.name)


def test_every_importorskip_is_covered_by_the_test_extra():
    modules = _importorskip_modules() - NOT_AN_EXTRA
    assert {"lm_eval", "fastapi", "torch"} <= modules  # the scan finds them
    required = _test_extra_distributions()
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(modules):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(module, [])}
        if not dists & {re.sub(r"[-_.]+", "-", r) for r in required}:
            missing[module] = sorted(dists) or "not installed"
    assert not missing, f"tests skip for modules the test extra does not install: {missing}"
