#!/usr/bin/env bash
# Prints the commit an image built from this working tree contains: HEAD, with -dirty when files differ
# from it (modified, staged or untracked but not ignored: the build context would carry them). Prints
# nothing outside a git checkout. `make image` labels the image with it; `make push` compares.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 0
head=$(git rev-parse HEAD 2>/dev/null) || exit 0
if [ -n "$(git status --porcelain 2>/dev/null)" ]; then
  echo "$head-dirty"
else
  echo "$head"
fi
