"""The README's and docs/**/*.md's relative links resolve inside the repository: each link
names a file or directory of the repository (never one outside it, such as a sibling
checkout a clone does not have), and its #anchor names a heading of the file it points
to. A path quoted in backticks that climbs out of its folder (`../x`) must also land on a
file of the repository. Plain file reads: no native build, no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CLIMB = re.compile(r"`(\.\./[^`\s]+)`")
_EXTERNAL = ("http://", "https://", "mailto:")


def _prose(path: Path) -> str:
    """The file's text without its fenced code blocks."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (repeats numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(path).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of one Markdown file (empty when nothing)."""
    problems = []
    text = _prose(path)
    targets = [(t, "link") for t in _LINK.findall(text)]
    targets += [(t, "quoted path") for t in _CLIMB.findall(text)]
    for target, kind in targets:
        if target.startswith(_EXTERNAL):
            continue
        where, _, anchor = target.partition("#")
        dest = (path.parent / where).resolve() if where else path
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{path.name}: {kind} {target!r} leaves the repository")
        elif not dest.exists():
            problems.append(f"{path.name}: {kind} {target!r}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.name}: {kind} {target!r}: no heading #{anchor} in "
                            f"{dest.name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(path: Path) -> None:
    assert link_problems(path) == []


def test_the_readme_links_the_architecture_page() -> None:
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_a_link_outside_the_repository_or_to_nothing_is_caught(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("# Title\n\n## Two words\n", encoding="utf-8")
    readme = repo / "README.md"
    readme.write_text(
        "[design](../shared/DESIGN.md) and `../shared/DESIGN.md`, [gone](docs/b.md),\n"
        "[bad anchor](docs/a.md#three), [good](docs/a.md#two-words), [web](https://x.org/),\n"
        "[here](#nowhere)\n\n```\n[in code](missing.md)\n```\n", encoding="utf-8")
    assert link_problems(readme, repo) == [
        "README.md: link '../shared/DESIGN.md' leaves the repository",
        "README.md: link 'docs/b.md': no such file",
        "README.md: link 'docs/a.md#three': no heading #three in a.md",
        "README.md: link '#nowhere': no heading #nowhere in README.md",
        "README.md: quoted path '../shared/DESIGN.md' leaves the repository",
    ]


def test_heading_anchors_follow_githubs_rules(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("# Instruction counts (AVX2 build)\n## Security\n## Security\n"
                   "### `make run`, then S3\n", encoding="utf-8")
    assert anchors(doc) == {"instruction-counts-avx2-build", "security", "security-1",
                            "make-run-then-s3"}
