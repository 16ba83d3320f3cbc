#!/usr/bin/env bash
# Download, as wheels for the GPU machine (Python 3.12, x86-64 Linux), the pure-Python dependencies of this
# project that its image lacks, into .whl/ (ignored by git); run_all.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
for pkg in pulp highspy graphviz jsonschema jsonschema-specifications referencing rpds-py torchdata plotly; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pkg"
done
ls .whl
