"""The docs cannot rot: README.md stays short with every feature one link away, every
relative link (and its anchor) resolves, the Python snippets marked ``<!-- runnable -->``
run, the config reference equals what the config dataclasses generate, and every bench is
listed."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)```", re.S)


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 6
    linked = {pathlib.Path(t.split("#")[0]).name for t in _LINK.findall(readme) if t.startswith("docs/")}
    assert set(pages) <= linked, f"pages the README does not link: {set(pages) - linked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    for target in _LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: {target}: no heading with that anchor"


SNIPPETS = [(p, i, code) for p in PAGES for i, code in enumerate(_RUNNABLE.findall(p.read_text()))]


@pytest.mark.parametrize("page, index, code", SNIPPETS, ids=[f"{p.name}-{i}" for p, i, _ in SNIPPETS])
def test_runnable_snippets_run(ray_session, page, index, code):
    exec(compile(code, f"{page.name} snippet {index}", "exec"), {"__name__": "__snippet__"})


def test_there_are_runnable_snippets():
    assert len(SNIPPETS) >= 3


def test_the_config_reference_is_generated_from_the_dataclasses():
    from mpmd.lm.config_doc import reference

    assert (ROOT / "docs" / "config.md").read_text() == reference(), \
        "docs/config.md is stale: python -m mpmd train --config-reference > docs/config.md"


def test_every_bench_is_listed():
    from benchmarks.benches import BENCHES

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert all(f"| `{name}` |" in text for name in BENCHES)
