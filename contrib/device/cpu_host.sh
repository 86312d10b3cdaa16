#!/usr/bin/env bash
# The CPU host-kind check, on a lent machine whose CPU is another kind than this project's
# 2-core hosts (the GPU machine's host processor, say): vlmd serves on CPUs, so what such a
# machine adds is one more instruction-set kind (AVX-512, VNNI, AMX) for the kernel tests and
# the floor measurements of issue 35. Pinned to 2 cores (taskset) so the figures read like a
# 2-vCPU host of that kind; no network needed.
#
#   contrib/device/cpu_host.sh [WHEELS_DIR]     # env: OUT (default /tmp/vlmd-cpu-host), CORES (default 0,1)
#
# WHEELS_DIR holds binary wheels of the dependencies the machine lacks (orjson, blake3,
# structlog, llguidance, openai and its needs), installed with --no-deps beside the machine's
# own torch and transformers. Results in $OUT: env.txt, tests.log, roofline.json,
# quantized.json, summary.txt. Every step has its own time limit so the whole run ends
# inside 9 minutes.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wheels="${1:-$repo/.whl}"
out="${OUT:-/tmp/vlmd-cpu-host}"
cores="${CORES:-0,1}"
mkdir -p "$out"
cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=""  # CPU only: the figures are the host processor's
step() { echo "== $1 ($(date -u +%H:%M:%S))" | tee -a "$out/summary.txt"; }

step "environment"
{ lscpu; echo; grep -o -w 'avx512[a-z_0-9]*\|amx[a-z_0-9]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  python3 -c 'import sys, torch, transformers; print(sys.version); print("torch", torch.__version__,
  "transformers", transformers.__version__, "threads", torch.get_num_threads())'; gcc --version | head -1; } \
  > "$out/env.txt" 2>&1
grep -E 'Model name|^CPU\(s\)|Flags' "$out/env.txt" | cut -c1-160 | tee -a "$out/summary.txt"

step "install (no network)"
# Into the machine's own Python environment (the one holding its torch; the machine is
# given back after the run): a venv made from it would not see its packages.
{ python3 -m pip install -q --no-deps "$wheels"/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . $(printf ' -e %s' plugins/*/); } \
  > "$out/install.log" 2>&1
tail -3 "$out/install.log"
ls vlmd/layers/cpu/_kernels_*.so 2>&1 | tee -a "$out/summary.txt"
python3 -c 'from vlmd.layers.cpu import library; print("kernel variant loaded:", getattr(library.load(), "variant", None))' 2>&1 \
  | tail -1 | tee -a "$out/summary.txt"

step "kernel tests on cores $cores"
timeout 200 taskset -c "$cores" python3 -m pytest -q -p no:cacheprovider --timeout 150 \
  tests/test_native_linear.py tests/test_native_kernels.py tests/test_native_decoder_step.py \
  tests/test_native_decoder_step_bf16.py tests/test_native_elementwise.py tests/test_native_prefill.py \
  tests/test_kernel_library.py tests/test_quantized_linear.py > "$out/tests.log" 2>&1
tail -4 "$out/tests.log" | tee -a "$out/summary.txt"

step "roofline, small LLaVA, cores $cores"
timeout 240 taskset -c "$cores" python3 contrib/bench/roofline.py --size small --num-requests 8 \
  > "$out/roofline.json" 2> "$out/roofline.err"
tail -c 1500 "$out/roofline.json" | tee -a "$out/summary.txt"; tail -3 "$out/roofline.err"

step "decode by weight format, cores $cores"
timeout 90 taskset -c "$cores" python3 contrib/bench/bench_quantized_decode.py --rounds 2 \
  > "$out/quantized.json" 2> "$out/quantized.err"
tail -c 1500 "$out/quantized.json" | tee -a "$out/summary.txt"; tail -3 "$out/quantized.err"
step "done"
