"""Every relative link in the project's Markdown (the README, docs/, benchmarks/, deploy/) leads
somewhere: to a file that exists and, with `#anchor`, to a heading that page has, as GitHub
names it. A page moved or a section renamed cannot leave a reader at a dead link.
"""

from __future__ import annotations

import re
from pathlib import Path

import trace_proxy

ROOT = Path(trace_proxy.__file__).resolve().parent.parent  # the checkout the tests run against
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("docs", "benchmarks", "deploy", "docker"):
        found += sorted((ROOT / folder).rglob("*.md"))
    return found


def prose(text: str) -> str:
    """The page without code: a `](` inside a code block or span is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    names: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        name, n = anchor_of(heading), 1
        unique = name
        while unique in names:  # GitHub numbers repeated headings: name, name-1, name-2
            unique, n = f"{name}-{n}", n + 1
        names.add(unique)
    return names


def dead_links(page: Path) -> list[str]:
    dead: list[str] = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            dead.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            dead.append(f"{target}: no heading with that anchor")
    return dead


def test_every_relative_link_in_the_docs_resolves() -> None:
    dead = {str(page.relative_to(ROOT)): found for page in pages() if (found := dead_links(page))}
    assert dead == {}


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Limits and `code` — *tested*\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Two words\n\n"
        "[ok](other.md) [ok](other.md#limits-and-code--tested) [ok](#two-words)\n"
        "[gone](missing.md) [wrong](other.md#nothing) [wrong](#three-words)\n"
        "`[not a link](nowhere.md)` [web](https://example.com/x)\n"
        "```\n[in a block](nowhere.md)\n```\n"
    )
    assert dead_links(page) == [
        "missing.md: no such file",
        "other.md#nothing: no heading with that anchor",
        "#three-words: no heading with that anchor",
    ]
