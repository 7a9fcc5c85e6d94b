"""The docs a newcomer reads stay true: the README stays short, lists every ``KVCHAT_*``
variable the code reads, every relative link in it and in docs/ leads somewhere, and
docs/architecture.md names every module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines = page.read_text(encoding="utf-8").splitlines()
    return {_slug(line.lstrip("#")) for line in lines if line.startswith("#")}


def test_the_readme_is_a_short_guide():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 320


def test_the_readme_lists_every_kvchat_variable_the_code_reads():
    read = {
        name
        for module in (ROOT / "kvchat").rglob("*.py")
        for name in re.findall(r"KVCHAT_[A-Z][A-Z_]*", module.read_text(encoding="utf-8"))
    }
    assert {"KVCHAT_HOME", "KVCHAT_NATIVE", "KVCHAT_LOCK_TIMEOUT"} <= read
    text = README.read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(KVCHAT_[A-Z_]+)", text, flags=re.MULTILINE))
    assert read <= rows, f"README's environment table lacks {sorted(read - rows)}"
    assert "| `KVCHAT_<NAME>` |" in text


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_architecture_page_names_every_module():
    """Every module of the package is named in docs/architecture.md, as a file (`x.py`,
    alone or after its folder): a module added, split off or renamed is placed there."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"[`/ ]([a-z_0-9]+\.py)\b", text))
    modules = {p.name for p in (ROOT / "kvchat").rglob("*.py") if p.name != "__init__.py"}
    assert {"layout.py", "app_view.py", "search_index.py"} <= modules
    assert sorted(modules - named) == []
