"""CI runs what the README tells a new user to run: `.ci/run` holds the README's install line and its test command
verbatim, so a README that drifts from CI (the index for torch's CPU wheel, once) fails here."""
from __future__ import annotations

import re

from ..conftest import REPO


def readme_commands(readme: str) -> tuple[str, str]:
    """(the install line of "Two commands", the test command of "Tests"): the first bash line of each section."""
    def first_bash_line(section: str) -> str:
        body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        block = re.search(r"```bash\n(.+?)\n```", body, re.S)
        assert block, f"README's '{section}' section has no bash block"
        return block.group(1).splitlines()[0].strip()
    return first_bash_line("Two commands"), first_bash_line("Tests")


def commands_ci_lacks(readme: str, ci_script: str) -> list[str]:
    lines = {line.strip() for line in ci_script.splitlines()}
    return [command for command in readme_commands(readme) if command not in lines]


def test_ci_runs_the_readmes_install_line_and_test_command() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install, test = readme_commands(readme)
    assert install.startswith("pip install torch==") and "--index-url https://download.pytorch.org/whl/cpu" in install
    assert test == "python3 -m pytest -q -n 2"
    assert commands_ci_lacks(readme, (REPO / ".ci" / "run").read_text(encoding="utf-8")) == []


def test_the_check_catches_a_ci_script_that_drifted() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install, _test = readme_commands(readme)
    drifted = (REPO / ".ci" / "run").read_text(encoding="utf-8").replace(" --index-url https://download.pytorch.org/whl/cpu", "")
    assert commands_ci_lacks(readme, drifted) == [install]


GLOSSARY_TERMS = ("1F1B", "tp (tensor parallel)", "dp (data parallel)", "sp (sequence parallel)", "ep (expert parallel)",
                  "island", "ZeRO-1", "local SGD", "MFU", "L0–L2", "stand-in", "replica", "bubble")


def test_the_glossary_defines_the_words_the_readme_uses_before_explaining_them() -> None:
    """A newcomer met 1F1B, sp/ep, islands, ZeRO-1, local SGD, MFU and L0-L2 before any definition: each has a row in
    docs/glossary.md, whose links all resolve, and the README links the glossary at the first of them (1F1B)."""
    glossary = (REPO / "docs" / "glossary.md").read_text(encoding="utf-8")
    rows = [line for line in glossary.splitlines() if line.startswith("| ") and not line.startswith("| Word")]
    for term in GLOSSARY_TERMS:
        assert any(term in row.split("|")[1] for row in rows), term
    for target in re.findall(r"\]\(([^)#]+)", glossary):
        assert (REPO / "docs" / target).is_file(), target
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = readme.index("1F1B")
    assert "docs/glossary.md" in readme[first:first + 200]
