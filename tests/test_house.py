"""The house stays walkable: small files (a source file over 400 lines, or a test file over 500, has
grown a second concern: split it by what it does)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def too_long(folder: Path, limit: int) -> list[str]:
    lengths = {p: len(p.read_text().splitlines()) for p in folder.rglob("*.py")}
    return sorted(f"{p.relative_to(ROOT)}: {n} lines" for p, n in lengths.items() if n > limit)


def test_no_source_file_is_over_400_lines():
    assert too_long(ROOT / "src", 400) == []


def test_no_test_file_is_over_500_lines():
    assert too_long(ROOT / "tests", 500) == []


def package_imports() -> dict[str, set[str]]:
    """For each folder of the package, the other folders its files import (lazy imports included)."""
    package = ROOT / "src" / "commsched"
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    edges: dict[str, set[str]] = {folder: set() for folder in folders}
    pattern = re.compile(r"^\s*(?:from|import) commsched\.(\w+)", re.M)
    for folder in folders:
        for source in (package / folder).rglob("*.py"):
            edges[folder] |= {name for name in pattern.findall(source.read_text()) if name in folders and name != folder}
    return edges


def test_no_loop_between_the_package_folders():
    edges = package_imports()
    loops = []

    def visit(folder: str, path: list[str]) -> None:
        for other in sorted(edges[folder]):
            if other in path:
                loops.append(" -> ".join(path[path.index(other):] + [other]))
            elif len(path) < len(edges):
                visit(other, path + [other])

    for folder in sorted(edges):
        visit(folder, [folder])
    assert loops == [], sorted(set(loops))[:10]
