"""Every relative link in README.md and docs/ leads somewhere: the file exists and, for a
link into a Markdown file, the heading its anchor names does too (GitHub's anchors). The
README's sections move to docs/ as they age; a moved section must not leave a dead link."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation but hyphens and
    underscores dropped, spaces to hyphens; a repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path):
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_anchors_follow_githubs_rule():
    page = ROOT / "README.md"
    assert "draft-vocabulary---draft-vocab-n" in anchors(page)  # (`--draft-vocab N`)
    assert "gpu-results-one-h200-2026-11-28-the-eighth-lease" in anchors(page)


def broken_links(page: Path) -> list[str]:
    broken = []
    # the whole prose at once: a link's text may wrap onto the next line
    for target in LINK.findall("\n".join(prose(page))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}: {target}: no such heading")
    return broken


def test_broken_links_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [gone](#another) [lost](lost.md)\n"
                    "```\n[in code](nowhere.md)\n```\n[a link that\nwraps](wrapped.md)\n")
    assert broken_links(page) == ["page.md: #another: no such heading",
                                  "page.md: lost.md: no such file",
                                  "page.md: wrapped.md: no such file"]


def test_relative_links_resolve():
    assert len(DOCS) > 10
    broken = [entry for page in DOCS for entry in broken_links(page)]
    assert not broken, broken
