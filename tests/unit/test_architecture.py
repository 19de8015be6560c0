"""docs/architecture.md's layers are the code's: every module of trainer/ is in one layer, imports only from
its own layer or lower ones, and no import cycle exists (imports inside functions are not counted)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devtools.processes import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "architecture.md"
TRAINER = REPO_ROOT / "trainer"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in TRAINER.rglob("*.py")}


def imports_at_module_level(path: Path, name: str = "") -> set[str]:
    """The trainer modules a module imports outside its functions (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    pending: list[ast.AST] = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("trainer"):
            module = node.module or ""
            found |= {f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                      for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("trainer")}
        pending.extend(ast.iter_child_nodes(node))
    return {module for module in found if module in MODULES} - {name or module_name(path)}


GRAPH = {name: imports_at_module_level(path) for name, path in MODULES.items()}


def layers() -> dict[str, int]:
    """Each module's layer, from the page's table: a folder entry covers every module under it."""
    entries: dict[str, int] = {}
    for line in PAGE.read_text().splitlines():
        row = re.match(r"\| (\d) \w+ \| (.+?) \| .+ \|$", line)
        if row:
            for path in re.findall(r"`(trainer/[^`]*)`", row.group(2)):
                entries[path] = int(row.group(1))
    owned: dict[str, int] = {}
    for name, path in MODULES.items():
        relative = path.relative_to(REPO_ROOT).as_posix()
        matches = [(len(entry), layer) for entry, layer in entries.items()
                   if relative == entry or (entry.endswith("/") and relative.startswith(entry))]
        assert matches, f"{relative} is in no layer of docs/architecture.md"
        owned[name] = max(matches)[1]
    for entry in entries:
        assert (REPO_ROOT / entry).exists(), f"docs/architecture.md names {entry}, which does not exist"
    return owned


def test_every_module_imports_only_from_its_own_layer_or_lower_ones():
    layer = layers()
    upward = [f"{source} (layer {layer[source]}) imports {target} (layer {layer[target]})"
              for source, targets in GRAPH.items() for target in targets if layer[target] > layer[source]]
    assert not upward, "; ".join(sorted(upward))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other_round_a_loop():
    assert cycles(GRAPH) == []


def test_the_checks_see_a_loop_and_an_import_hidden_under_type_checking(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    hidden = tmp_path / "config.py"
    hidden.write_text("from typing import TYPE_CHECKING\n\nimport trainer.errors\n\nif TYPE_CHECKING:\n"
                      "    from trainer.loop import Trainer\n\n\ndef later():\n    from trainer import api\n")
    assert imports_at_module_level(hidden, "trainer.config") == {"trainer.errors", "trainer.loop"}
