"""Print the requirements in pyproject.toml, one per line, for pip: the dependencies (ranges) and the
``tested`` extra's pins, so that the image has the versions CI tests; with ``--extras``, those extras' too.

The image installs the dependencies in a layer of their own, before the trainer's code, so that
editing the code does not reinstall PyTorch; CI downloads the same list into its wheelhouse.

    python3 docker/requirements.py pyproject.toml [--build-system] [--extras mlflow,wandb]

``--build-system`` adds ``[build-system] requires``, which an offline ``pip install .`` needs too.
``--extras`` adds the named optional dependencies (the image's ``EXTRAS`` build argument): an extra that names
the package itself (``ddp-deploy[s3]``) is replaced by that extra's list.
"""

from __future__ import annotations

import re
import sys
import tomllib

USAGE = "usage: requirements.py PYPROJECT_TOML [--build-system] [--extras NAME[,NAME...]]"


class UnknownExtra(ValueError):
    pass


def requirements(pyproject_path: str, build_system: bool, extras: tuple[str, ...] = ()) -> list[str]:
    with open(pyproject_path, "rb") as file:
        pyproject = tomllib.load(file)
    project = pyproject["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    listed: list[str] = list(project["dependencies"]) + optional["tested"]
    for extra in extras:
        listed += _expanded(extra, optional, project["name"], seen=set())
    if build_system:
        listed += pyproject["build-system"]["requires"]
    return list(dict.fromkeys(listed))  # each once, in order


def _expanded(extra: str, optional: dict[str, list[str]], package: str, seen: set[str]) -> list[str]:
    if extra not in optional:
        raise UnknownExtra(f"no extra {extra!r} in pyproject.toml; choose from {', '.join(sorted(optional))}")
    if extra in seen:
        return []
    seen.add(extra)
    listed: list[str] = []
    for requirement in optional[extra]:
        itself = re.fullmatch(rf"{re.escape(package)}\[([^\]]+)\]", requirement.replace(" ", ""))
        if itself:
            for inner in itself.group(1).split(","):
                listed += _expanded(inner, optional, package, seen)
        else:
            listed.append(requirement)
    return listed


def main(argv: list[str]) -> int:
    arguments = list(argv)
    extras: tuple[str, ...] = ()
    if "--extras" in arguments:
        at = arguments.index("--extras")
        if at + 1 >= len(arguments):
            print(USAGE, file=sys.stderr)
            return 2
        extras = tuple(name.strip() for name in arguments[at + 1].split(",") if name.strip())
        del arguments[at:at + 2]
    build_system = "--build-system" in arguments
    if build_system:
        arguments.remove("--build-system")
    if len(arguments) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        print("\n".join(requirements(arguments[0], build_system, extras)))
    except UnknownExtra as error:
        print(f"docker/requirements.py: {error} (the EXTRAS build argument)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
