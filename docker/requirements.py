"""Print the requirements in pyproject.toml, one per line, for pip: the dependencies (ranges) and the
``tested`` extra's pins, so that the image has the versions CI tests.

The image installs the dependencies in a layer of their own, before the trainer's code, so that
editing the code does not reinstall PyTorch; CI downloads the same list into its wheelhouse.

    python3 docker/requirements.py pyproject.toml [--build-system]

``--build-system`` adds ``[build-system] requires``, which an offline ``pip install .`` needs too.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject_path: str, build_system: bool) -> list[str]:
    with open(pyproject_path, "rb") as file:
        pyproject = tomllib.load(file)
    listed: list[str] = list(pyproject["project"]["dependencies"])
    listed += pyproject["project"]["optional-dependencies"]["tested"]
    if build_system:
        listed += pyproject["build-system"]["requires"]
    return listed


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] != "--build-system"):
        print("usage: requirements.py PYPROJECT_TOML [--build-system]", file=sys.stderr)
        return 2
    print("\n".join(requirements(argv[0], build_system=len(argv) == 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
