#!/bin/bash
# Regenerates constraints.txt at the repo root: a fresh resolve, in a throwaway virtual
# environment, of vlmd's dependencies, its test extras, torch and the build tools (the
# image builds its wheels with them), written as exact pins. Both the image (Dockerfile)
# and CI (.ci/run exports PIP_CONSTRAINT) install through it.
#
# The resolve is for this interpreter (CPython 3.11 on Linux x86-64, as the image and CI).
# torch comes from the CPU wheel index, so the pins hold torch's CPU dependencies only (a
# CUDA torch brings its own exact pins for its nvidia-* packages). Where the CPU index is
# unreachable but pip's own settings already offer the CPU wheel (a local wheel folder),
# run it with TORCH_INDEX= (empty).
#
# usage: contrib/docker/constraints.sh      (then review `git diff constraints.txt`)
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCH=${TORCH:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
unset PIP_CONSTRAINT  # a fresh resolve: not bounded by the file being replaced
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" \
    ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$TORCH" '.[test]' 'setuptools>=68' wheel
"$work/venv/bin/python" - "$work/report.json" "$TORCH_INDEX" > constraints.txt <<'PY'
import json
import platform
import sys

report = json.load(open(sys.argv[1]))
local = {"vlmd"}  # installed from this checkout (and its plugins): never pinned here
pins = sorted((item["metadata"]["name"].lower().replace("_", "-"), item["metadata"]["version"])
              for item in report["install"] if item["metadata"]["name"].lower() not in local)
print(f"""\
# Exact versions for vlmd, its test extras, torch and the build tools (setuptools, wheel):
# a fresh resolve on CPython {platform.python_version()} / Linux {platform.machine()}. The image installs
# through this file (Dockerfile) and so does CI (.ci/run sets PIP_CONSTRAINT), so both get
# the same versions. torch's line has no local label: 2.13.0 matches the CPU build
# (2.13.0+cpu, from https://download.pytorch.org/whl/cpu) and a CUDA one alike.
# Regenerate: contrib/docker/constraints.sh (a throwaway venv; review the diff).""")
for name, version in pins:
    print(f"{name}=={version.split('+')[0]}")
PY
echo "wrote constraints.txt: $(grep -vc '^#' constraints.txt) pins" >&2
