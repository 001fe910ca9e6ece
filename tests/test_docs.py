"""The documentation: README.md stays a front door, every page of docs/ is in mkdocs.yml's
navigation (and every entry there is a page), no page refers to issue numbers, and the site builds
strictly (broken links and anchors are errors) with no warning at all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# "issue 29", "Issue 33's", "issues 11 and 19", "(#12)"; not an HTML entity such as "&#124;"
ISSUE_REFERENCE = re.compile(r"\bissues?\s+\d+|(?<![&\w])#\d+\b", re.IGNORECASE)


def _nav_pages(nav: object) -> list[str]:
    """Every page a mkdocs `nav` names, in order (entries are "page.md", {title: "page.md"} or
    {title: [entries]})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for entry in nav for page in _nav_pages(entry)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    raise AssertionError(f"unexpected nav entry {nav!r}")


def _config() -> dict:
    # NOTE: mkdocs.yml has no !!python tags, so the safe loader reads it whole
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_the_readme_is_a_front_door() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines (at most {README_MAX_LINES}); move reference to docs/"


def test_the_reference_finder_finds_issue_numbers() -> None:
    found = [text for text in ("as in issue 29", "Issue 33's seams", "issues 11 and 19", "fixed (#12)")
             if ISSUE_REFERENCE.search(text)]
    assert len(found) == 4, found
    assert not ISSUE_REFERENCE.search("a `|` is &#124; in a table; the issue is latency; step 2 of 3")


def test_no_page_refers_to_issue_numbers() -> None:
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in [ROOT / "README.md", *_pages()]
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if ISSUE_REFERENCE.search(line)]
    assert not found, "say what the thing is, not which issue it came from:\n" + "\n".join(found)


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page() -> None:
    config = _config()
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), nav
    pages = {str(path.relative_to(DOCS)) for path in _pages()}
    assert sorted(pages - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - pages) == [], "nav entries with no page in docs/"


def test_broken_links_fail_the_build() -> None:
    links = _config()["validation"]["links"]
    assert links == {"not_found": "warn", "anchors": "warn", "absolute_links": "warn", "unrecognized_links": "warn"}


def test_the_site_builds_strictly_with_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    # NOTE: mkdocs-material prints a banner about MkDocs 2.0 at import (it says "warning"); not the site's
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    warnings = [line for line in output.splitlines() if "warn" in line.lower()]
    assert not warnings, output


def test_no_issue_numbers_in_the_cli_help() -> None:
    """The commands' help (descriptions come from module docstrings) is user-facing text too."""
    import argparse
    import re

    from pdserve.cli import build_parser

    def walk(parser: argparse.ArgumentParser) -> list[str]:
        texts = [parser.format_help()]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    texts += walk(sub)
        return texts

    found = [text for text in walk(build_parser()) if re.search(r"\b(issue|DIGEST item)s? \d+", text, re.I)]
    assert not found, found[0][:2000]
