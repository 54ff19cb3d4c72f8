"""The documentation: the README is a short front door linked both ways with the pages of docs/, every relative link
and anchor resolves, and the table of measures in docs/measures.md is the one the registry generates."""

import re

from conftest import ROOT

from analysis.frontends import measure_table as MT

PAGES = ["training", "data", "measures", "analysis", "studies", "scaling", "development"]  # written by hand
REPORTS = ["reproduction", "teaching-matters", "registers", "real-vit"]  # written by the studies' commands
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_the_measure_table_is_generated_from_the_registry():
    committed = MT.DOC.read_text()
    assert MT.render(committed, MT.table()) == committed, (
        f"docs/measures.md's table of measures differs from the registry's: run {MT.COMMAND} and commit the result"
    )


def test_every_measure_has_a_one_sentence_summary_and_a_definition():
    text = MT.DOC.read_text()
    for name, cls in MT.project_measures().items():
        s = MT.summary(cls)
        assert s.endswith(".") and 20 < len(s) <= 116, f"{name}: the docstring's first line is its summary: {s!r}"
        assert f"#### `{name}`" in text, f"docs/measures.md has no definition of {name} (#### `{name}`)"


def test_the_readme_is_a_front_door_linked_both_ways_with_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert first_block.startswith("./launch.sh ") and "\n./launch.sh test " in first_block  # what CI runs (.ci/run)
    for page in PAGES + REPORTS:
        assert f"](docs/{page}.md)" in readme, f"the README does not link docs/{page}.md"
    for page in PAGES:
        first = (ROOT / "docs" / f"{page}.md").read_text().splitlines()[0]
        assert first.startswith("[← README](../README.md)"), f"docs/{page}.md does not open with a link to the README"


def test_every_relative_link_and_anchor_resolves():
    for doc in [ROOT / "README.md", *(ROOT / "docs" / f"{p}.md" for p in PAGES)]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: {target}"
            assert file.is_relative_to(ROOT), f"{where} leaves the repository"
            assert file.exists(), f"{where}: no such file"
            if anchor:
                assert anchor in anchors(file), f"{where}: no such heading"
