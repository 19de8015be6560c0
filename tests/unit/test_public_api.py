"""The public API (docs/api.md): what code outside trainer/ may import, and that it imports nothing else.

bench/, scripts/, torchx_components/ and examples/ are the trainer's first users: they show what a user
can build on. Every `from trainer.X import Y` there must name a module of trainer.PUBLIC_MODULES (or the
package itself) and a name its __all__ lists.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import trainer
from devtools.processes import REPO_ROOT

OUTSIDE = ("bench", "scripts", "torchx_components", "examples", "kubeflow_sdk")


def imports_of_trainer(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of the trainer in a file; names empty for `import trainer.X`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.split(".")[0] == "trainer"]
    return found


def test_every_public_module_lists_its_names_and_they_exist():
    for module_name in ("trainer", *trainer.PUBLIC_MODULES):
        module = importlib.import_module(module_name)
        assert isinstance(getattr(module, "__all__", None), list), f"{module_name} has no __all__"
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.__all__ names {name}, which it does not define"


@pytest.mark.parametrize("folder", OUTSIDE)
def test_code_outside_the_package_uses_only_the_public_api(folder):
    offences = []
    files = sorted((REPO_ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    for path in files:
        for line, module_name, names in imports_of_trainer(path):
            where = f"{path.relative_to(REPO_ROOT)}:{line}"
            if module_name != "trainer" and module_name not in trainer.PUBLIC_MODULES:
                offences.append(f"{where}: {module_name} is not a public module")
                continue
            listed = importlib.import_module(module_name).__all__
            offences += [f"{where}: {module_name}.{name} is not in its __all__" for name in names if name not in listed]
    assert not offences, "\n".join(offences)


def test_importing_the_package_alone_does_not_load_torch():
    import subprocess
    import sys

    probe = "import sys, trainer; print(trainer.__version__, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert result.stdout.split() == [trainer.__version__, "False"]
