"""Every relative link in README.md, docs/*.md and benchmarks/**/README.md resolves: its file or folder
exists and its ``#anchor`` names a heading there (scripts/check_doc_links.py, GitHub's slugs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_doc_links", ROOT / "scripts" / "check_doc_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_doc_link_resolves() -> None:
    links = checker()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("**/README.md"))]
    assert [problem for page in pages for problem in links.broken(page)] == []


def test_the_check_finds_a_missing_file_and_heading(tmp_path: Path) -> None:
    """Negative control: a missing file and a missing heading are reported, a heading's slug is not."""
    links = checker()
    (tmp_path / "other.md").write_text("# It's `here` (issue 1)\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#its-here-issue-1) [b](missing.md) [c](other.md#not-a-heading) "
                    "[d](https://example.com/x.md) [e](#top)\n\n# Top\n")
    links.ROOT = tmp_path
    assert links.broken(page) == ["page.md: missing.md (no such file)", "page.md: other.md#not-a-heading (no such heading)"]
