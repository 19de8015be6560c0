"""The README's layout table matches the tree, and every page it links to exists."""

from __future__ import annotations

import re
import subprocess

from devtools.processes import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def layout_paths() -> set[str]:
    table = README.split("## Repository layout", 1)[1]
    return {path.rstrip("/") for row in table.splitlines() if row.startswith("| `")
            for path in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_every_module_and_folder_is_in_the_layout_table_and_every_entry_exists():
    listed = layout_paths()
    modules = {f"trainer/{path.name}" for path in (REPO_ROOT / "trainer").iterdir()
               if (path.suffix == ".py" and path.name != "__init__.py") or (path / "__init__.py").is_file()}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    folders = {line.split("/")[0] for line in tracked.splitlines() if "/" in line}
    folders.discard("trainer")
    assert modules - listed == set(), "trainer modules missing from the README's layout table"
    assert folders - listed == set(), "top-level folders missing from the README's layout table"
    assert [path for path in listed if not (REPO_ROOT / path).exists()] == []


def test_every_linked_page_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and [link for link in links if not (REPO_ROOT / link).exists()] == []
