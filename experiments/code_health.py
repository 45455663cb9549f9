"""Code-health figures of a source tree: import layering, the longest functions, and
repeated code.

  (i)   the import graph of asynclane_jax/ and checkpoints_convert/ (read with `ast`,
        module-level and function-local imports: tests/import_graph.py, the builder
        tests/project/test_layering.py uses): upward edges from the library core
        (asynclane_jax.decoding, asynclane_jax.models) into the applications, and
        import cycles (strongly connected components of more than one module);
  (ii)  the 15 longest functions and methods of asynclane_jax/ and checkpoints_convert/
        (lines from `def` to the last line of the body, decorators not counted);
  (iii) the pairs of places the `duplicates` command reports in each of asynclane_jax/,
        checkpoints_convert/, tests/ and experiments/ (run on each folder alone, so
        pairs across folders are not counted; its default six shared lines);
  (iv)  sizes: functions over LONG_FUNCTION lines, modules over LONG_MODULE lines, the
        installed package (the files a wheel built from the tree holds, uncompressed;
        `--no-wheel` skips the build), and the number of files in tests/, experiments/
        and experiments/results/.

Usage:
  python experiments/code_health.py                      # this tree, printed
  python experiments/code_health.py --write     # and experiments/results/health/code_health.md
  git worktree add /tmp/before REV
  python experiments/code_health.py --root /tmp/before \\
      --write experiments/results/health/code_health_before.md
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import import_graph  # noqa: E402  (tests/import_graph.py)

FUNCTION_TREES = ("asynclane_jax", "checkpoints_convert")
DUPLICATE_TREES = ("asynclane_jax", "checkpoints_convert", "tests", "experiments")
N_LONGEST = 15
LONG_FUNCTION = 80
LONG_MODULE = 600


def _functions(node: ast.AST, rel: str, prefix: str = ""):
    """(lines, "file:line", qualified name) of every function below node, nested ones
    included (as "outer.<locals>.inner")."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            yield child.end_lineno - child.lineno + 1, f"{rel}:{child.lineno}", name
            yield from _functions(child, rel, f"{name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, rel, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, rel, prefix)


def longest_functions(root: pathlib.Path, n: int = N_LONGEST) -> list[tuple[int, str, str]]:
    """(lines, "file:line", qualified name) of the n longest functions, longest first."""
    found = []
    for tree_name in FUNCTION_TREES:
        for path in sorted((root / tree_name).rglob("*.py")):
            if "__pycache__" not in path.parts:
                tree = ast.parse(path.read_text(), filename=str(path))
                found += _functions(tree, path.relative_to(root).as_posix())
    return sorted(found, key=lambda f: (-f[0], f[1]))[:n]


def all_functions(root: pathlib.Path) -> list[tuple[int, str, str]]:
    """(lines, "file:line", qualified name) of every function, longest first."""
    return longest_functions(root, n=10**9)


def long_modules(root: pathlib.Path, limit: int = LONG_MODULE) -> list[tuple[int, str]]:
    """(lines, path) of the modules of FUNCTION_TREES over `limit` lines, longest first."""
    found = []
    for tree_name in FUNCTION_TREES:
        for path in (root / tree_name).rglob("*.py"):
            if "__pycache__" not in path.parts:
                n = len(path.read_text().splitlines())
                if n > limit:
                    found.append((n, path.relative_to(root).as_posix()))
    return sorted(found, reverse=True)


def installed_size(root: pathlib.Path) -> tuple[int, int] | None:
    """(files, bytes uncompressed) of a wheel built from the tree: what `pip install`
    puts in site-packages (the dist-info included); None when the build fails."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                               "-w", out, str(root)], capture_output=True, text=True,
                              check=False)
        wheels = list(pathlib.Path(out).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            return None
        with zipfile.ZipFile(wheels[0]) as z:
            infos = [i for i in z.infolist() if not i.is_dir()]
            return len(infos), sum(i.file_size for i in infos)


def file_counts(root: pathlib.Path) -> dict[str, int]:
    """Files on disk: test modules (tests/, every folder), scripts (experiments/, top
    level) and results (experiments/results/, every folder)."""
    counts = {}
    for folder, pattern, deep in (("tests", "test_*.py", True), ("experiments", "*.py", False),
                                  ("experiments/results", "*", True)):
        base = root / folder
        found = base.rglob(pattern) if deep else base.glob(pattern)
        counts[folder] = sum(1 for p in found if p.is_file() and "__pycache__" not in p.parts)
    return counts


def duplicates(folder: pathlib.Path) -> dict:
    """The `duplicates` command's pair count and rows for one folder."""
    exe = shutil.which("duplicates")
    if exe is None:
        return {"pairs": None, "rows": [], "notes": ["`duplicates` is not on PATH"]}
    out = subprocess.run([exe, "--repo", str(folder), "--most", "200", "--seconds", "300"],
                         capture_output=True, text=True, check=False).stdout
    lines = out.strip().splitlines()
    head = lines[0] if lines else ""
    m = re.match(r"(\d+) pairs? of places", head)
    pairs = int(m.group(1)) if m else (0 if head.startswith("no duplicates") else None)
    rows = [ln for ln in lines if re.match(r"D\d+ ", ln)]
    notes = [ln for ln in lines[1:] if ln.startswith(("left out:", "incomplete:", "(+"))]
    return {"pairs": pairs, "rows": rows, "notes": notes, "head": head}


def report(root: pathlib.Path, wheel: bool = True) -> str:
    modules, edges = import_graph.build(root)
    upward = import_graph.upward_edges(edges)
    cycles = import_graph.strongly_connected(modules, edges)
    functions = all_functions(root)
    longest = functions[:N_LONGEST]
    dups = {t: duplicates(root / t) for t in DUPLICATE_TREES if (root / t).is_dir()}
    rev = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"],
                         capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                            *FUNCTION_TREES, "tests", "experiments"],
                           capture_output=True, text=True, check=False).stdout.strip()

    total = sum(d["pairs"] or 0 for d in dups.values())
    over = [f for f in functions if f[0] > LONG_FUNCTION]
    big = long_modules(root)
    size = installed_size(root) if wheel else None
    counts = file_counts(root)
    out = ["# Code health", "",
           f"Tree: `{root}` at {rev or '(not a git checkout)'}"
           + (" with uncommitted changes" if dirty else "") + ".",
           "Made by `experiments/code_health.py` (import graph: `tests/import_graph.py`).", "",
           "| figure | value |", "| --- | --- |",
           f"| modules / import edges | {len(modules)} / {len(edges)} |",
           f"| upward edges (core -> applications) | {len(upward)} |",
           f"| import cycles (modules in them) | {len(cycles)} "
           f"({sum(len(c) for c in cycles)}) |",
           f"| longest function (lines) | {longest[0][0] if longest else 0} |",
           f"| {N_LONGEST} longest functions, lines in all | {sum(f[0] for f in longest)} |",
           f"| duplicate pairs, all folders | {total} |"]
    out += [f"| duplicate pairs, {t}/ | {d['pairs'] if d['pairs'] is not None else '?'} |"
            for t, d in dups.items()]
    out += [f"| functions over {LONG_FUNCTION} lines | {len(over)} |",
            f"| modules over {LONG_MODULE} lines | {len(big)} |",
            "| installed package (files, MB uncompressed) | "
            + (f"{size[0]}, {size[1] / 1e6:.1f} |" if size else "not measured |")]
    out += [f"| files: {k} | {v} |" for k, v in counts.items()]
    out += ["", f"Functions over {LONG_FUNCTION} lines: "
            + (", ".join(f"`{name}` ({n}, `{where}`)" for n, where, name in over) or "none")
            + ".", "",
            f"Modules over {LONG_MODULE} lines: "
            + (", ".join(f"`{path}` ({n})" for n, path in big) or "none") + "."]

    out += ["", "## Import graph", "",
            "Upward edges: a module of " + ", ".join(f"`{c}`" for c in import_graph.CORE)
            + " importing " + ", ".join(f"`{u}`" for u in import_graph.UPPER) + ".", ""]
    out += [f"- `{e}`" for e in upward] or ["- none"]
    out += ["", "Import cycles (strongly connected components of more than one module), "
            "each with the edges inside it:", ""]
    for comp in cycles:
        out.append(f"- {len(comp)} modules: " + ", ".join(f"`{m}`" for m in comp))
        out += [f"  - `{e}`" for e in import_graph.cycle_edges(comp, edges)]
    if not cycles:
        out.append("- none")

    out += ["", f"## The {N_LONGEST} longest functions", "",
            "| lines | where | function |", "| ---: | --- | --- |"]
    out += [f"| {n} | `{where}` | `{name}` |" for n, where, name in longest]

    out += ["", "## Repeated code (`duplicates`, each folder alone)", ""]
    for t, d in dups.items():
        out.append(f"### {t}/ (pairs: {d['pairs'] if d['pairs'] is not None else '?'})")
        out.append("")
        shown = ([d["head"]] if d.get("head") else []) + d["rows"] + d["notes"]
        out += [f"    {ln}" for ln in shown]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=pathlib.Path, default=REPO,
                    help="the source tree to read (default: this checkout)")
    ap.add_argument("--write", nargs="?", type=pathlib.Path, metavar="PATH",
                    const=REPO / "experiments" / "results" / "health" / "code_health.md",
                    help="also write the report (default path: "
                         "experiments/results/health/code_health.md of this checkout)")
    ap.add_argument("--no-wheel", action="store_true",
                    help="skip building a wheel to measure the installed package")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if not (root / "asynclane_jax").is_dir():
        ap.error(f"--root {root}: no asynclane_jax/ folder there")
    text = report(root, wheel=not args.no_wheel)
    print(text, end="")
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}", file=sys.stderr)


if __name__ == "__main__":
    main()
