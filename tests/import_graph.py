"""The module import graph of the package, read from the source with `ast` (nothing is
imported): used by tests/project/test_layering.py and experiments/code_health.py.

Every `import` and `from ... import` statement counts, at module level or inside a
function (or under `if TYPE_CHECKING:`), and only edges between the tree's own modules
are kept. An edge goes to the module named:

  import asynclane_jax.decoding.ops             -> asynclane_jax.decoding.ops
  import asynclane_jax                          -> asynclane_jax (the package __init__)
  from asynclane_jax.decoding import ops        -> asynclane_jax.decoding.ops (a submodule)
  from asynclane_jax import load                -> asynclane_jax (a name of the __init__)
  from . import tasks / from .tasks import x    -> resolved against the importing package

`import a.b.c` also runs a/__init__ and a/b/__init__; those implied edges are not added
(every module would otherwise depend on its own package's __init__). Imports built at
run time (`importlib.import_module(f"...")`) are not seen.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

PACKAGES = ("asynclane_jax", "checkpoints_convert")


@dataclasses.dataclass(frozen=True)
class Edge:
    """`src` imports `dst` at `path`:`line`; `local` when the import is inside a function."""

    src: str
    dst: str
    path: str  # relative to the root
    line: int
    local: bool

    def __str__(self) -> str:
        where = "function-local" if self.local else "top-level"
        return f"{self.src} -> {self.dst}  ({self.path}:{self.line}, {where})"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def source_files(root: pathlib.Path, packages=PACKAGES) -> dict[str, pathlib.Path]:
    """Module name -> file, for every .py below the packages' folders."""
    files = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path, root)] = path
    return files


def _local_imports(tree: ast.AST) -> set[int]:
    """The ids of import nodes that sit inside a function body."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    inside.add(id(node))
    return inside


def _known_prefix(name: str, modules) -> str | None:
    """The longest dotted prefix of name that is one of the modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(module: str, path: pathlib.Path, root: pathlib.Path, modules) -> list[Edge]:
    """The edges from one module to the tree's modules."""
    tree = ast.parse(path.read_text(), filename=str(path))
    local = _local_imports(tree)
    rel = path.relative_to(root).as_posix()
    is_package = path.name == "__init__.py"
    edges = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_known_prefix(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if alias.name != "*" and sub in modules
                               else _known_prefix(base, modules))
        for dst in targets:
            if dst is not None and dst != module:
                edges.append(Edge(module, dst, rel, node.lineno, id(node) in local))
    return sorted(set(edges), key=lambda e: (e.src, e.dst, e.line))


def build(root: str | pathlib.Path, packages=PACKAGES) -> tuple[list[str], list[Edge]]:
    """(every module, every edge between them) of the tree at root."""
    root = pathlib.Path(root).resolve()
    files = source_files(root, packages)
    edges = []
    for module, path in files.items():
        edges += imports_of(module, path, root, files)
    return sorted(files), edges


def strongly_connected(modules, edges) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module, each
    sorted, in order of their first member (Tarjan's algorithm, iterative)."""
    succ = {m: sorted({e.dst for e in edges if e.src == m}) for m in modules}
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def cycle_edges(component, edges) -> list[Edge]:
    """The edges that stay inside one strongly connected component."""
    members = set(component)
    return [e for e in edges if e.src in members and e.dst in members]


# The layering rule: the library core never reaches up into the applications.
CORE = ("asynclane_jax.decoding", "asynclane_jax.models")
UPPER = ("asynclane_jax.testbed", "asynclane_jax.harness", "asynclane_jax.cli",
         "asynclane_jax.generate_cli", "asynclane_jax.bench", "asynclane_jax.aot",
         "asynclane_jax.serve")


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def upward_edges(edges, core=CORE, upper=UPPER) -> list[Edge]:
    """Edges from a module of the core packages to an application module."""
    return [e for e in edges if _within(e.src, core) and _within(e.dst, upper)]


def describe_cycles(modules, edges) -> list[str]:
    """One paragraph per cycle: its members, then the edges that close it."""
    out = []
    for comp in strongly_connected(modules, edges):
        lines = [f"cycle of {len(comp)} modules: {', '.join(comp)}"]
        lines += [f"    {e}" for e in cycle_edges(comp, edges)]
        out.append("\n".join(lines))
    return out
