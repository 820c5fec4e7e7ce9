"""The README and docs/ say what the tree holds: the README's config-group lists are conf/'s
options, every profile a page cites exists, every README headline number is in the record
(docs/results.md), every `make` target the Makefile declares has a rule, and the README stays a
front door: about 120 lines, a docs map naming every page of docs/, links that resolve (the
README's, docs/'s and the records' READMEs and MANIFEST under experiments/results/)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]}


def _readme_config_groups() -> dict[str, set[str]]:
    paragraph = README[README.index("Config groups (`conf/`"):].split("\n\n")[0]
    return {group: {o.strip() for o in options.split(",")}
            for group, options in re.findall(r"`([a-z_]+)`\s+\(([^)]*)\)", paragraph)}


def test_readme_lists_every_option_of_every_run_config_group():
    listed = _readme_config_groups()
    defaults = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/config.yaml"))["defaults"]
    groups = {next(iter(d)) for d in defaults if isinstance(d, dict)}
    assert set(listed) == groups
    for group, options in listed.items():
        present = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        patterns = [o for o in options if o.endswith("*")]
        expanded = (options - set(patterns)) | {p for p in present for o in patterns if p.startswith(o[:-1])}
        assert expanded == present, f"README's `{group}` list: missing {sorted(present - expanded)}, " \
                                    f"not in conf/{group}/: {sorted(expanded - present)}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_profile_a_page_cites_exists(page):
    cited = set(re.findall(r"experiments/profiles/[\w.-]+\.csv", PAGES[page]))
    assert not [c for c in cited if not (ROOT / c).exists()]


def test_every_readme_headline_number_is_in_the_record():
    """The README's headline figures are copied from docs/results.md, with their configuration;
    a figure changed in one place only is caught here."""
    record = PAGES["docs/results.md"]
    table = README[README.index("## Headline figures"):]
    for row in (line for line in table.splitlines() if line.startswith("| ") and "---" not in line):
        figure, value = [c.strip() for c in row.strip("|").split("|")][:2]
        missing = [n for n in re.findall(r"\d[\d,.]*\d|\d", value) if n not in record]
        assert not missing, f"README headline '{figure}': {missing} not in docs/results.md"


def test_every_phony_make_target_has_a_rule():
    makefile = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M)[1].split()
    rules = set(re.findall(r"^([\w-]+):", makefile, re.M))
    assert not [t for t in phony if t not in rules]


README_MAX_LINES = 122  # a front door; details live in docs/, history in git and docs/history.md


def test_readme_stays_a_front_door():
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): " \
                                      "move per-feature detail into its docs/ page"


def test_readme_docs_map_names_every_docs_page():
    table = README[README.index("## Documentation"):].split("\n## ")[0]
    mapped = set(re.findall(r"^\| \[(docs/[\w.-]+\.md)\]", table, re.M))
    pages = {p for p in PAGES if p.startswith("docs/")}
    assert mapped == pages, f"README's docs map: missing {sorted(pages - mapped)}, " \
                            f"not in docs/: {sorted(mapped - pages)}"


def _github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_readme_link_resolves():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README links to {path}, which does not exist"
        if anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_github_anchor(h) for h in headings}, \
                f"README links to {target}: no heading of {path} has the anchor #{anchor}"


def _links(text: str) -> list[str]:
    """A page's relative link targets, code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("page", sorted({*PAGES, *(p.relative_to(ROOT).as_posix()
                                                   for p in ROOT.glob("experiments/results/**/*.md"))}))
def test_every_link_of_the_docs_and_records_resolves(page):
    path = ROOT / page
    for target in _links(path.read_text()):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{page} links to {target}: {file} does not exist"
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            assert anchor in {_github_anchor(h) for h in headings}, \
                f"{page} links to {target}: no heading of {dest.name} has the anchor #{anchor}"
