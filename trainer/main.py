"""Entry point: ``ddp-train``, ``python -m trainer``, and the script ``trainer/main.py``.

Runs as a script too (``torchrun trainer/main.py``, ``torchx run dist.ddp ... trainer/main.py``); all
of them call trainer.run, the Python API, which parses the config, joins the group, builds, trains
and always tears down.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # started as a script: make the package importable from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.api import run


def main(argv: Sequence[str] | None = None) -> int:
    return run(argv=argv)


if __name__ == "__main__":
    sys.exit(main())
