"""The task pages stay true to the tree.

`docs/architecture.md` names every module under `src/tandem/` (one line each) and only files
that exist; `docs/benchmarks.md` gives each area a date, the command that produced it and raw
JSON that exists under `bench/results/`; every relative link in README.md and docs/ reaches
a file, and every `#anchor` a heading of its page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tandem"
DOCS = ROOT / "docs"
ARCH = DOCS / "architecture.md"
BENCH = DOCS / "benchmarks.md"
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _section(text: str, heading: str) -> str:
    """The text under `heading` (a `## ` line), up to the next `## ` heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _modules() -> set[str]:
    return {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
            if p.name != "__init__.py" and "_pb2" not in p.name}


def _listed(section: str) -> list[str]:
    """The paths a list item of the section starts with (`- \\`PATH\\` — ...`)."""
    return re.findall(r"^- `([^`]+)` — ", section, re.M)


def test_architecture_lists_every_module_once() -> None:
    listed = _listed(_section(ARCH.read_text(encoding="utf-8"), "## Modules"))
    py = [p for p in listed if p.endswith(".py")]
    assert sorted(_modules() - set(py)) == [], "modules missing from docs/architecture.md"
    assert sorted({p for p in py if py.count(p) > 1}) == [], "modules listed twice"


def test_architecture_names_only_files_that_exist() -> None:
    modules = _section(ARCH.read_text(encoding="utf-8"), "## Modules")
    inside, _, outside = modules.partition("### Outside `src/`")
    missing = [p for p in _listed(inside) if not (SRC / p).is_file()]
    missing += [p for p in _listed(outside) if not (ROOT / p).exists()]
    assert missing == []


def test_architecture_change_table_names_existing_paths() -> None:
    table = _section(ARCH.read_text(encoding="utf-8"), "## To change X, open Y")
    paths = [p for row in table.splitlines() if row.startswith("| ") and " | `" in row
             for p in re.findall(r"`([\w./*-]+)`", row.split(" | ", 1)[1])
             if "/" in p or p.endswith((".py", ".yaml", ".json"))]
    assert paths, "the table names no path"
    bad = [p for p in paths if not any((base / p.split("*")[0]).exists() or
                                       list(base.glob(p)) for base in (SRC, ROOT))]
    assert bad == []


def test_benchmark_results_named_on_the_page_exist() -> None:
    text = BENCH.read_text(encoding="utf-8")
    named = set(re.findall(r"bench/results/[\w.*-]+", text))
    assert len(named) >= 12
    assert sorted(p for p in named if not list(ROOT.glob(p))) == []


def test_every_benchmark_area_has_date_command_and_raw_json() -> None:
    areas = re.split(r"^## ", BENCH.read_text(encoding="utf-8"), flags=re.M)[1:]
    assert len(areas) >= 13
    for area in areas:
        name = area.splitlines()[0]
        if name == "GPU check":
            assert "not run on a GPU" in area or "No GPU has run it" in area
            continue
        assert re.search(r"\b2026-\d\d-\d\d\b", area), f"{name}: no date"
        assert "python bench/" in area, f"{name}: no command"
        assert "bench/results/" in area, f"{name}: no raw JSON"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Its headings' slugs and its explicit `id="..."` anchors."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a (?:id|name)="([^"]+)"', text))
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code (a regex, say) holds no link
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md"
                                 and anchor not in _anchors(dest)):
            bad.append(target)
    assert bad == []
