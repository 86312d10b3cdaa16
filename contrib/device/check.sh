#!/usr/bin/env bash
# The first thing to run on a lent GPU (issue 46): one script, no network, about 8 minutes.
#
#   1. install vlmd and every plugin (plugins/*/) from the wheels contrib/device/pack.sh made,
#      with --no-deps beside the machine's own CUDA torch and transformers;
#   2. the flex backend's parity cases on the GPU, through the compiled FlexAttention kernel,
#      against a float64 reference (tests/test_flex_attention.py);
#   3. every family's parity tests on the GPU: vlmd's greedy tokens against transformers'
#      on the same device, float32 (VLMD_TEST_DEVICE for vlmd, VLMD_ORACLE_DEVICE for
#      transformers; selected by -k "(parity and not tp2) or matches_transformers");
#   4. real-size throughput: a random bf16 checkpoint of Qwen2.5-VL-7B's shape built on the
#      GPU (contrib/device/real_shape.py), served by vlmd, driven by contrib/bench/bench_chat.py
#      at c1 and c16 with one 1024x1024 image and 128 output tokens a request: TTFT, time per
#      output token, req/s, GPU memory, beside the floor.
#
# From the repository root, with the device tool (its $OUT comes back):
#   here:   contrib/device/pack.sh                        # -> contrib/device/wheels (39 MiB)
#   there:  run(command="bash contrib/device/check.sh", carry=["contrib/device/wheels"], timeout_s=600)
# The dry run here, on the CPU at the tiny sizes (a reduced parity set; minutes, not hours):
#   contrib/device/pack.sh /tmp/wheels-cpu 3.11 && DEVICE=cpu PYTHON=.venv/bin/python contrib/device/check.sh /tmp/wheels-cpu
#
# env: DEVICE (cuda), OUT (/tmp/vlmd-device-check), PYTHON (python3), and each step's limit in
# seconds: FLEX_S (120), PARITY_S (240), BENCH_S (270). Results in $OUT (at most 8 files, as
# the device tool returns): summary.txt (read this first), env.txt, install.log, flex.log,
# parity.log, bench.json, server.log. Exit status 0 only if every step passed.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wheels="$(cd "${1:-$repo/contrib/device/wheels}" 2>/dev/null && pwd || echo "${1:-$repo/contrib/device/wheels}")"
device="${DEVICE:-cuda}"
out="${OUT:-/tmp/vlmd-device-check}"
python="${PYTHON:-python3}"
work="$(mktemp -d /tmp/vlmd-check.XXXXXX)"  # scratch: the installed packages, checkpoints, pytest's cwd
site="$work/site"
mkdir -p "$out"
rm -f "$out"/summary.txt
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if [ "$device" = cpu ]; then
    shape=tiny
    parity_select=("$repo"/tests/test_{llava_parity,whisper_parity}.py -k "parity_default or language_detection")
    bench_args=(--concurrency 1 16 --num-requests 16 --output-tokens 16)
else
    shape=qwen2.5-vl-7b
    parity_select=("$repo"/tests/test_{llava_parity,qwen2_vl,qwen2_5_vl,qwen3_vl,qwen3_vl_moe,gemma3,internvl,mllama}.py
                   "$repo"/tests/test_{qwen2_audio,whisper_parity}.py -k "(parity and not tp2) or matches_transformers")
    bench_args=(--concurrency 1 16 --num-requests 32 --output-tokens 128)
fi
status=0
note() { echo "$*" | tee -a "$out/summary.txt"; }
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
# pytest's closing line ("N passed, M failed in S s"), or why there is none.
closing() { grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)' "$1" | tail -1 | tr -d '='; }

step "environment"
{ date -u; "$python" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__,
  [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv 2>/dev/null || true; } \
  > "$out/env.txt" 2>&1
cat "$out/env.txt"
note "vlmd device check: DEVICE=$device, $(head -2 "$out/env.txt" | tail -1)"

step "install from $wheels"
plugin_wheels=$(ls "$wheels"/vlmd_*.whl 2>/dev/null | wc -l)
plugins=$(ls -d "$repo"/plugins/*/ | wc -l)
if ! ls "$wheels"/vlmd-*.whl >/dev/null 2>&1 || [ "$plugin_wheels" -ne "$plugins" ]; then
    note "install: FAILED: $wheels lacks vlmd or some of the $plugins plugins' wheels (run contrib/device/pack.sh here)"
    exit 2
fi
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
    > "$out/install.log" 2>&1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# Every test and bench below runs from $work, so vlmd is the installed one, not the tree's.
if ! (cd "$work" && "$python" - "$site" "$plugins" "$device" >> "$out/install.log" 2>&1 <<'PY'
import sys, torch, vlmd
from vlmd.plugins.manager import tiny_builders
site, plugins, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print("vlmd from", vlmd.__file__, "families", sorted(tiny_builders()))
assert vlmd.__file__.startswith(site), "vlmd is not the installed wheel"
assert len(tiny_builders()) >= plugins, "a plugin's entry point is missing"
assert device == "cpu" or torch.cuda.is_available(), "no CUDA device"
PY
); then
    note "install: FAILED (install.log)"; tail -5 "$out/install.log"; exit 2
fi
note "install: vlmd and $plugins plugins from wheels ($(tail -1 "$out/install.log"))"

run_tests() {  # limit log args...: pytest from the scratch folder, the repo's tests and settings
    local limit="$1" log="$2"; shift 2
    (cd "$work" && VLMD_TEST_DEVICE="$device" VLMD_ORACLE_DEVICE="$device" timeout "$limit" "$python" -m pytest -q \
        -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" "$@") > "$log" 2>&1
}

step "flex backend parity on $device"
run_tests "${FLEX_S:-120}" "$out/flex.log" "$repo/tests/test_flex_attention.py" -k "not server and not body"
code=$?; [ $code -ne 0 ] && status=1
note "flex kernel parity (tests/test_flex_attention.py, float64 reference, on $device): $(closing "$out/flex.log")$([ $code = 124 ] && echo ' TIMED OUT')"

step "family parity on $device"
run_tests "${PARITY_S:-240}" "$out/parity.log" "${parity_select[@]}"
code=$?; [ $code -ne 0 ] && status=1
note "family parity (vlmd vs transformers, greedy, float32, both on $device): $(closing "$out/parity.log")$([ $code = 124 ] && echo ' TIMED OUT')"
grep -E '^(FAILED|ERROR) ' "$out/parity.log" | head -8 | tee -a "$out/summary.txt"

step "throughput: $shape"
bench_started=$(date +%s)
if ! timeout 120 "$python" "$repo/contrib/device/real_shape.py" --out "$work/checkpoint" --shape "$shape" \
        --device "$device" > "$work/real_shape.json" 2> "$work/real_shape.log"; then
    note "throughput: FAILED building the checkpoint: $(tail -3 "$work/real_shape.log")"; status=1
else
    sampler=""
    if [ "$device" != cpu ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$work/gpu_memory.csv" 2>/dev/null &
        sampler=$!
    fi
    # One server for the warm-up and the measurement: the warm-up (other pixels, so no cache
    # serves the measured requests) compiles FlexAttention and captures the decode graphs of
    # the batch sizes c16 reaches, which would otherwise land inside the measured run.
    port=8311
    url="http://127.0.0.1:$port"
    (cd "$work" && exec "$python" -m vlmd serve "$work/checkpoint" --port "$port" --served-model-name bench \
        --device "$device" --dtype bfloat16 --max-model-len 4096 --limit-mm-per-prompt image=1) > "$work/server.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do
        "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' "$url/health" \
            >/dev/null 2>&1 && break
        kill -0 "$server" 2>/dev/null || break
        sleep 0.5
    done
    bench() { (cd "$work" && timeout $(( ${BENCH_S:-270} - ($(date +%s) - bench_started) )) "$python" \
        "$repo/contrib/bench/bench_chat.py" --url "$url" --model bench "$@"); }
    bench --concurrency 16 --num-requests 16 --output-tokens 16 --width 1000 --height 1000 > /dev/null 2> "$work/bench.log" \
        && bench --width 1024 --height 1024 "${bench_args[@]}" > "$out/bench.json" 2>> "$work/bench.log"
    code=$?
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
    tail -c 200000 "$work/server.log" > "$out/server.log"
    [ $code -ne 0 ] && { status=1; note "throughput: FAILED ($code$([ $code = 124 ] && echo ', timed out')): $(tail -3 "$work/bench.log")"; }
    "$python" - "$out/bench.json" "$work/real_shape.json" "$work/gpu_memory.csv" "$out/server.log" \
        >> "$out/summary.txt" <<'PY'
import json, sys
from pathlib import Path
bench_path, shape_path, memory_path, log_path = map(Path, sys.argv[1:])
shape = json.loads(shape_path.read_text())
print(f"throughput: {shape['shape']} shape, random bfloat16, {shape['num_parameters'] / 1e6:,.1f}M parameters, "
      f"{shape['weight_bytes'] / 2**20:,.1f} MiB of weights (built in {shape['seconds']} s)")
text = bench_path.read_text().strip() if bench_path.exists() else ""
if text:
    bench = json.loads(text.splitlines()[-1])
    print(f"  one {bench['image']} image and {bench['output_tokens']} output tokens a request (ignore_eos), streamed")
    for level, row in bench["results"].items():
        itl = row["itl_p50_s"]
        print(f"  {level}: {row['req_per_s']} req/s, TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms (p90 "
              f"{row['ttft_p90_s'] * 1e3:.0f}), time per output token (inter-token p50) "
              f"{itl * 1e3:.2f} ms, {row['requests']} requests in {row['wall_s']} s" if itl is not None else row)
floor = shape["weight_bytes"] / 4.8e12 * 1e3
print(f"  floor: the weights read once a step over 4.8 TB/s = {floor:.3f} ms a token at batch 1; issue 46's goal: "
      "within 2x of TTFT 150 ms and 8 ms a token at c1, 10 req/s at c16")
if memory_path.exists() and memory_path.stat().st_size:
    used = [int(line) for line in memory_path.read_text().split() if line.strip().isdigit()]
    print(f"  GPU memory (nvidia-smi, every 0.5 s): peak {max(used)} MiB used")
plan = [line for line in log_path.read_text(errors="replace").splitlines() if "memory plan" in line] \
    if log_path.exists() else []
if plan:
    try:
        fields = json.loads(plan[-1])
        parts = ("weight_bytes", "activation_bytes", "encoder_peak_bytes", "kv_bytes", "planned_bytes")
        print("  vlmd's memory plan (GiB): " + ", ".join(
            f"{name.removesuffix('_bytes')} {fields[name] / 2**30:.2f}" for name in parts if name in fields)
            + f"; {fields.get('num_kv_blocks')} KV blocks of {fields.get('block_size')}")
    except ValueError:  # a text log line
        print(f"  vlmd's memory plan: {plan[-1][-600:]}")
PY
fi

note "status: $status (0: every step passed)"
rm -rf "$work"
exit $status
