"""The README's quickstart block runs as written (CPU here, the reference kernels), and every
relative link in the README and the documentation resolves to a file (and heading) of the
repository."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [
    README,
    ROOT / "CHANGELOG.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
# Pages other branches of issue 66 write (the integrations rewrite, the standard ONNX mode):
# linked from here already, checked once they exist. Empty this set when both have merged.
# [text](target) and ![alt](target), targets without a scheme.
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")


def test_quickstart_block_runs():
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    assert namespace["o"].shape == (1, 200, 4, 64)
    assert namespace["state"].shape == (1, 4, 64, 64)


def test_readme_stays_short():
    """The README is the newcomer's page: what and why, set-up, quickstart, support matrix
    and links; everything else lives in docs/."""
    assert len(README.read_text().splitlines()) <= 250


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens and underscores
    dropped, spaces to hyphens (outside code blocks)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    links = _links(document)
    for target in links:
        file_part, _, anchor = target.partition("#")
        resolved = (document.parent / file_part).resolve() if file_part else document
        assert resolved.exists(), f"{document.relative_to(ROOT)} links to missing {target}"
        if anchor:
            assert resolved.suffix == ".md", f"{target}: an anchor into a non-Markdown file"
            assert anchor in _anchors(resolved), (
                f"{document.relative_to(ROOT)} links to {target}, a heading "
                f"{resolved.relative_to(ROOT)} does not have"
            )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(README)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page in linked, f"README.md does not link to {page.relative_to(ROOT)}"
