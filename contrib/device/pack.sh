#!/usr/bin/env bash
# What contrib/device/check.sh installs on the device machine, which has no network (its own
# CUDA torch, transformers and most of vlmd's needs are there: .library's KINDS.md lists them):
#
#   - vlmd as a pure-Python wheel: setup.py only builds the CPU kernels, tagged for the
#     Python that builds them (3.11 here, 3.12 there), and a CUDA run does not use them
#     (vlmd then serves CPU work through torch ops and says so once);
#   - every plugin under plugins/*/ (pure Python);
#   - the dependencies the device lacks, binary wheels for its Python (pinned to what this
#     project's venv runs), installed there with --no-deps beside its own packages.
#
#   contrib/device/pack.sh [OUT_DIR] [PYTHON_VERSION]   # default contrib/device/wheels (git-ignored), 3.12
#
# The device run carries OUT_DIR (run's `carry`), so the whole working tree plus OUT_DIR must
# stay under 64 MiB: this script fails past PACK_LIMIT_MIB (default 56). PYTHON_VERSION 3.11
# packs for this host (the DEVICE=cpu dry run of check.sh). Needs network for the
# dependencies (PyPI), nothing else.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$repo/contrib/device/wheels}"
pyver="${2:-3.12}"
python="${PYTHON:-python3}"
limit_mib="${PACK_LIMIT_MIB:-56}"
# The device lacks these (vlmd imports the first four at start-up; soundfile and soxr read
# audio uploads, av video): the versions this project is tested with.
deps="orjson==3.13.0 blake3==1.0.11 structlog==26.1.0 llguidance==1.9.1 soundfile==0.14.0 soxr==1.1.0 av==18.1.0"

rm -rf "$out" && mkdir -p "$out"
source_copy="$(mktemp -d)"
trap 'rm -rf "$source_copy"' EXIT
# The tracked files as they are in the work tree (uncommitted edits included), minus setup.py.
(cd "$repo" && git ls-files -z | xargs -0 cp --parents -t "$source_copy")
rm "$source_copy/setup.py"
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$source_copy"
for plugin in "$source_copy"/plugins/*/; do
    "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$plugin"
done
# pip matches a manylinux tag exactly: every glibc level up to the device's (Ubuntu 24.04, 2.39).
platforms=$(for n in 17 24 27 28 31 34 35 39; do printf -- '--platform manylinux_2_%s_x86_64 ' "$n"; done)
# shellcheck disable=SC2086
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    $platforms --platform manylinux2014_x86_64 -d "$out" $deps 2> >(grep -v "is ignored: it is neither" >&2)

plugins=$(ls -d "$repo"/plugins/*/ | wc -l)
built=$(ls "$out" | grep -c '^vlmd' || true)
if [ "$built" -ne $((plugins + 1)) ]; then
    echo "pack: expected vlmd and $plugins plugin wheels, built $built" >&2; exit 1
fi
if ls "$out"/vlmd-*.whl | grep -qv 'py3-none-any'; then
    echo "pack: the vlmd wheel is not pure Python" >&2; exit 1
fi
tree_kib=$(cd "$repo" && git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
pack_kib=$(du -sk "$out" | cut -f1)
echo "pack: $(ls "$out" | wc -l) wheels in $out, $((pack_kib / 1024)) MiB (+ $((tree_kib / 1024)) MiB of tracked files)"
if [ $(((pack_kib + tree_kib) / 1024)) -ge "$limit_mib" ]; then
    echo "pack: over $limit_mib MiB with the working tree; the device carries 64 MiB in all" >&2; exit 1
fi
