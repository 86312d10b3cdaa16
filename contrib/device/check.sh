#!/usr/bin/env bash
# The CUDA check, on a machine with a CUDA GPU and PyTorch and no network, within 10 minutes:
#   1. install vlmd without network: from WHEELS_DIR (contrib/device/build_wheels.sh made it),
#      or, with no wheels there, the source tree itself (pip -e, no deps, no build isolation);
#   2. the parity tests (LLaVA, Qwen2-VL, Whisper: greedy tokens equal transformers') with the
#      server and engines on DEVICE (VLMD_TEST_DEVICE; transformers stays on the CPU);
#   3. the throughput benchmark (contrib/bench/bench_chat.py, tiny LLaVA) on DEVICE.
#
#   contrib/device/check.sh [WHEELS_DIR]       # env: DEVICE (default cuda), OUT (default /tmp/vlmd-device-check)
#
# Results: $OUT/env.txt, $OUT/parity.log, $OUT/parity.xml, $OUT/bench.json, $OUT/summary.txt.
# Exit status: 0 only if the install, every parity test and the benchmark succeeded.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wheels="${1:-$repo/contrib/device/wheels}"
device="${DEVICE:-cuda}"
out="${OUT:-/tmp/vlmd-device-check}"
mkdir -p "$out"
cd "$repo"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
status=0
step() { echo "== $1 ($(date -u +%H:%M:%S))" | tee -a "$out/summary.txt"; }

step "environment"
{ python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
  "available", torch.cuda.is_available(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true; } \
  > "$out/env.txt" 2>&1
cat "$out/env.txt"

step "install (no network)"
# A venv that sees the machine's own torch (and whatever else it has installed).
python3 -m venv --system-site-packages "$out/venv" && . "$out/venv/bin/activate"
if ls "$wheels"/vlmd-*.whl >/dev/null 2>&1; then
    pip install -q --no-index --find-links "$wheels" vlmd vlmd-llava vlmd-qwen2-vl vlmd-whisper pytest \
        pytest-timeout openai >"$out/install.log" 2>&1
else
    pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/vlmd_llava -e plugins/vlmd_qwen2_vl \
        -e plugins/vlmd_whisper >"$out/install.log" 2>&1
fi
if ! python -c 'import vlmd, vlmd_llava, vlmd_qwen2_vl, vlmd_whisper, torch; assert torch.cuda.is_available() or "'"$device"'" == "cpu"'; then
    echo "install failed or no CUDA device; see $out/install.log" | tee -a "$out/summary.txt"; tail -20 "$out/install.log"; exit 2
fi

step "parity tests on $device"
VLMD_TEST_DEVICE="$device" timeout 420 python -m pytest -q -p no:cacheprovider --junitxml "$out/parity.xml" \
    tests/test_llava_parity.py tests/test_qwen2_vl.py tests/test_whisper_parity.py tests/test_cost.py \
    >"$out/parity.log" 2>&1 || status=1
tail -15 "$out/parity.log" | tee -a "$out/summary.txt"

step "throughput benchmark on $device"
timeout 150 python contrib/bench/bench_chat.py --size tiny --concurrency 1 8 --num-requests 16 --output-tokens 32 \
    --server-flag=--device --server-flag="$device" >"$out/bench.json" 2>"$out/bench.log" || status=1
cat "$out/bench.json" | tee -a "$out/summary.txt"
# The server's memory plan from its start-up log (weights, activations, encoder peak, KV blocks).
grep -h '"memory plan"' /tmp/vlmd-bench-*.log 2>/dev/null | tail -1 | tee -a "$out/summary.txt"

step "done: status $status"
exit $status
