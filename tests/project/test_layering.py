"""The package's layering, read statically from the source (tests/import_graph.py: `ast`,
nothing imported; module-level and function-local imports alike).

  * The library core (asynclane_jax.decoding, asynclane_jax.models) never imports the
    applications built on it: the testbed, the lm-eval harness, the command lines, the
    benchmark, ahead-of-time compilation.
  * No import cycles among the modules of asynclane_jax and checkpoints_convert: no
    strongly connected component of more than one module in the module -> module graph
    (a function-local import closing a cycle counts: it only defers the cycle).
"""

from __future__ import annotations

import pathlib

import import_graph

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _graph():
    modules, edges = import_graph.build(ROOT)
    assert "asynclane_jax.decoding" in modules and "asynclane_jax.models" in modules
    assert len(edges) > 20  # the graph was read at all
    return modules, edges


def test_core_does_not_import_the_applications():
    _, edges = _graph()
    upward = import_graph.upward_edges(edges)
    assert not upward, (
        f"{len(upward)} import(s) from the library core "
        f"({', '.join(import_graph.CORE)}) up into "
        f"{', '.join(import_graph.UPPER)}:\n" + "\n".join(f"  {e}" for e in upward))


def test_no_import_cycles():
    modules, edges = _graph()
    cycles = import_graph.describe_cycles(modules, edges)
    assert not cycles, (f"{len(cycles)} import cycle(s) among the package's modules:\n"
                        + "\n".join(cycles))


def test_the_graph_builder_sees_what_it_must(tmp_path):
    """The builder itself: relative, submodule, package and function-local imports, and
    a cycle and an upward edge where there are ones."""
    pkg = tmp_path / "asynclane_jax"
    for sub in ("decoding", "testbed"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from asynclane_jax.decoding import ops\n")
    (pkg / "decoding" / "ops.py").write_text("import numpy\nfrom . import api\n")
    (pkg / "decoding" / "api.py").write_text(
        "def f():\n    from asynclane_jax.testbed.tasks import check\n"
        "    from asynclane_jax import load\n")
    (pkg / "testbed" / "tasks.py").write_text("from ..decoding import ops\n")
    (tmp_path / "checkpoints_convert").mkdir()
    modules, edges = import_graph.build(tmp_path)
    got = {(e.src, e.dst, e.local) for e in edges}
    assert got == {
        ("asynclane_jax", "asynclane_jax.decoding.ops", False),
        ("asynclane_jax.decoding.ops", "asynclane_jax.decoding.api", False),
        ("asynclane_jax.decoding.api", "asynclane_jax.testbed.tasks", True),
        ("asynclane_jax.decoding.api", "asynclane_jax", True),
        ("asynclane_jax.testbed.tasks", "asynclane_jax.decoding.ops", False),
    }
    assert [(e.src, e.dst) for e in import_graph.upward_edges(edges)] == [
        ("asynclane_jax.decoding.api", "asynclane_jax.testbed.tasks")]
    assert import_graph.strongly_connected(modules, edges) == [
        ["asynclane_jax", "asynclane_jax.decoding.api", "asynclane_jax.decoding.ops",
         "asynclane_jax.testbed.tasks"]]
