"""The results folder and the pages that cite it stay in step.

- Every `experiments/results/...` path named in README.md, docs/*.md, the results pages
  (experiments/results/**/*.md) and the package's source names a file or folder that
  exists, so a moved or deleted result fails here instead of leaving a stale link.
  Brace lists (`bench_x.{md,json}`) are expanded; `*`, `<placeholder>` and upper-case
  placeholders (`MODEL`, `NAME`) must match at least one file.
- Every file under experiments/results/ but archive/ is listed, by its path inside
  experiments/results/, in the index experiments/results/README.md, and each folder's
  heading there counts its files.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
INDEX = RESULTS / "README.md"

PATH = re.compile(r"experiments/results/[A-Za-z0-9_.{},*<>/-]*")


def citing_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(RESULTS.rglob("*.md"))]
    for pkg in ("asynclane_jax", "checkpoints_convert"):
        files += sorted(p for p in (ROOT / pkg).rglob("*")
                        if p.suffix in (".py", ".md") and p.is_file())
    return [p for p in files if p.exists()]


def expand(path: str) -> list[str]:
    """Expand the first {a,b} group, recursively; a {name} without a comma (a format
    field) is a placeholder."""
    path = re.sub(r"\{[A-Za-z_]+\}", "*", path)
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",")
            for x in expand(path[:m.start()] + alt + path[m.end():])]


def as_glob(path: str) -> str:
    path = re.sub(r"<[^<>]*>", "*", path)
    return re.sub(r"(?<![a-z])[A-Z][A-Z0-9]+(?![a-z])", "*", path)


def resolves(path: str) -> bool:
    path = path.rstrip(".,;:)`'\"")
    if path.endswith("/"):
        return (ROOT / path).exists()
    if "." not in path.rsplit("/", 1)[-1]:  # a folder, or an output stem (`--out STEM`)
        return (ROOT / path).exists() or any((ROOT / path).parent.glob(
            (ROOT / path).name + ".*"))
    for one in expand(path):
        pattern = as_glob(one)
        found = (ROOT / one).exists() if "*" not in pattern else any(ROOT.glob(pattern))
        if not found:
            return False
    return True


def cited_paths() -> list[tuple[str, str]]:
    found = []
    for f in citing_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in PATH.finditer(text):
            found.append((str(f.relative_to(ROOT)), m.group(0)))
    return found


def test_the_scan_finds_citations():
    cited = cited_paths()
    assert len(cited) > 50
    assert any(p.startswith("README.md") for p, _ in cited)


def test_every_cited_results_path_exists():
    stale = sorted({f"{where}: {path}" for where, path in cited_paths() if not resolves(path)})
    assert not stale, "results paths that do not exist:\n" + "\n".join(stale)


def test_every_results_file_but_the_archive_is_in_the_index():
    index = INDEX.read_text(encoding="utf-8")
    missing = []
    for p in sorted(RESULTS.rglob("*")):
        rel = p.relative_to(RESULTS).as_posix()
        if not p.is_file() or p == INDEX or rel.startswith("archive/"):
            continue
        if f"`{rel}`" not in index:
            missing.append(rel)
    assert not missing, ("files in experiments/results/ not listed in its README.md:\n"
                         + "\n".join(missing))


def test_each_folder_heading_counts_its_files():
    """Each `### folder/: ... (N files)` heading of the index says how many files the
    folder holds (archive/ too)."""
    heading = re.compile(r"^### ([A-Za-z0-9_-]+)/: .*\((\d+) files?\)\s*$", re.M)
    found = heading.findall(INDEX.read_text(encoding="utf-8"))
    assert len(found) >= 5
    wrong = [f"{name}/: the heading says {n}, the folder holds {held}"
             for name, n in found
             if (held := sum(p.is_file() for p in (RESULTS / name).rglob("*"))) != int(n)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path, ok", [
    ("experiments/results/README.md", True),
    ("experiments/results/no_such_file.md", False),
    ("experiments/results/bench/bench_tiny-llada-v4b.{md,json,png}", True),
    ("experiments/results/bench/bench_tiny-llada-v4b.{md,jsonx}", False),
    ("experiments/results/asynclane/decode_order_*.png", True),
    ("experiments/results/baselines/eb_<model>.md", True),
    ("experiments/results/archive/asynclane_fork_fresh_MODEL_256.json", True),
    ("experiments/results/testbed/testbed_{name}.png", True),
    ("experiments/results/bench/", True),
    ("experiments/results/serve/serve", True),  # an --out stem: serve.md, serve.json
    ("experiments/results/serve/no_such_stem", False),
])
def test_resolves(path, ok):
    assert resolves(path) is ok
