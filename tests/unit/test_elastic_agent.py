"""ddp-torchrun's own checks, made before torchrun starts anything (trainer/elastic_agent.py)."""

from __future__ import annotations

import pytest

from trainer.elastic_agent import main
from trainer.errors import EXIT_USAGE


@pytest.mark.parametrize(("nnodes", "said"), [
    ("3:2", "--nnodes=3:2: the minimum must be at least 1 and at most the maximum (MIN:MAX, such as 1:2)"),
    ("0:2", "--nnodes=0:2: the minimum must be at least 1 and at most the maximum"),
    ("two", "--nnodes=two is neither a number of nodes nor MIN:MAX"),
    ("1:2:3", "--nnodes=1:2:3 is neither a number of nodes nor MIN:MAX"),
])
def test_node_bounds_torchrun_would_assert_on_are_one_line_and_exit_2(nnodes, said, capsys):
    # torch 2.14's torchrun: a bare AssertionError (or ValueError) traceback for each of these.
    code = main([f"--nnodes={nnodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1", "--no-python", "true"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith(f"ddp-torchrun: error: {said}") and err.count("\n") == 1, err
