#!/usr/bin/env bash
# Fetch the wheels experiments/gpu/h200.sh installs on an H200 machine without PyPI access
# (Python 3.12) into <repo>/.whl, git-ignored through .git/info/exclude; copy the checkout with
# .whl/ to that machine. They are jsonschema (adaptiveload.experiment) and its three
# dependencies, and pandas pinned to the version the project is tested with (the machine's is
# unknown). Run on a machine with PyPI access; about 13 MB.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST="$REPO/.whl"
PY=${PYTHON:-python3}
WHEELS=(
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 pandas==3.1.1
)
EXCLUDE="$(git -C "$REPO" rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")" "$DEST"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
du -sh "$DEST"
