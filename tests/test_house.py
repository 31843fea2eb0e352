"""The house stays walkable: small files (a source file over 400 lines, or a test file over 500, has
grown a second concern: split it by what it does)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def too_long(folder: Path, limit: int) -> list[str]:
    lengths = {p: len(p.read_text().splitlines()) for p in folder.rglob("*.py")}
    return sorted(f"{p.relative_to(ROOT)}: {n} lines" for p, n in lengths.items() if n > limit)


def test_no_source_file_is_over_400_lines():
    assert too_long(ROOT / "src", 400) == []


def test_no_test_file_is_over_500_lines():
    assert too_long(ROOT / "tests", 500) == []
