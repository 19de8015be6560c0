"""docs/sharded.md's recipe for reading a sharded checkpoint with torch alone is the one the tests run: its lines are
tests.workers.dcp_recipe.restore's, which tests/integration/test_sharded.py runs with and without a process group."""

from __future__ import annotations

import inspect

from devtools.processes import REPO_ROOT
from tests.workers.dcp_recipe import restore


def test_the_pages_recipe_is_the_tested_one_line_for_line():
    page = (REPO_ROOT / "docs" / "sharded.md").read_text()
    block = page.split("**Reading our checkpoints with DCP alone**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    # The page's lines but its imports (with their continuation) and its example path (``restore`` is given one).
    left_out = ("import", "from", " ", "checkpoint =")
    shown = [line for line in block.splitlines() if line and not line.startswith(left_out)]
    tested = [line.strip() for line in inspect.getsource(restore).splitlines()[1:]]
    assert shown == tested
