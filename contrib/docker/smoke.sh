#!/bin/bash
# Smoke test of the image: build it cold, build it again after a one-line code edit (only the
# last layers may run), then run it three times:
#   A. as its own user: time to a 200 on /health, one image chat through the API, the image's
#      HEALTHCHECK command run inside the container, then SIGTERM (`stop`) once ready;
#   B. SIGTERM while the model loads (before /health answers);
#   C. as an arbitrary UID in the root group (`--user 12345:0`, OpenShift-style): /health, the
#      chat, and the cache directory and HOME writable.
# Prints one JSON line; exits 1 if any check failed. Progress and the build logs go to $WORK.
#
# usage: contrib/docker/smoke.sh [MODEL_DIR]   (no MODEL_DIR: the image's built-in tiny model)
# The build context is a snapshot of the commit (git archive HEAD), so the edit never touches
# the checkout; SRC=DIR builds DIR instead (copied first).
# ENGINE=docker (the default where `docker info` works): docker build / docker run.
# ENGINE=podman: no daemon; builds with BUILD_SH, a buildah wrapper invoked as
#   SRC=CONTEXT $BUILD_SH [buildah bud args] that tags localhost/vlmd:cpu (on the team's
#   machines: ../shared/notes/containers/build.sh, which also gives the build the host's pip
#   settings), runs with podman on runc and cgroupfs.
# Other settings: PORT (host port, --network host; default 18080), PYTHON_IMAGE (base image
# build argument), BUILD_ARGS (more build arguments), SKIP_BUILD=1 (test the image as built).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MODEL_DIR=${1:-}
PORT=${PORT:-18080}
WORK=${WORK:-$(mktemp -d /tmp/vlmd-smoke.XXXXXX)}
mkdir -p "$WORK"
if [ -z "${ENGINE:-}" ]; then
    if docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
if [ "$ENGINE" = podman ]; then
    E=(podman --runtime runc --storage-driver overlay --cgroup-manager cgroupfs --events-backend file)
    IMAGE=localhost/vlmd:cpu
    # podman's default ulimits cannot be set on every host; these are docker's usual ones.
    RUN_ARGS=(--network host --ulimit nofile=10000:10000 --ulimit nproc=4096:4096)
else
    E=(docker)
    IMAGE=${IMAGE:-vlmd:smoke}
    RUN_ARGS=(--network host)
fi
now() { date +%s.%N; }
since() { python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$1" "$(now)"; }
say() { echo "[$(date -u +%T)] $*" >&2; }
FAILED=()
fail() { say "FAILED: $*"; FAILED+=("$*"); }

# --- build -----------------------------------------------------------------------------------
build() {  # build NAME [args]: builds $WORK/src, log in $WORK/build-NAME.log; prints seconds
    local name=$1; shift
    local extra=("$@")
    [ -n "${PYTHON_IMAGE:-}" ] && extra+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
    # shellcheck disable=SC2206
    extra+=(${BUILD_ARGS:-})
    local t0 rc
    t0=$(now)
    if [ "$ENGINE" = podman ]; then
        SRC="$WORK/src" "${BUILD_SH:?ENGINE=podman needs BUILD_SH (a buildah wrapper)}" --format docker "${extra[@]}" \
            > "$WORK/build-$name.log" 2>&1
        rc=$?
    else
        DOCKER_BUILDKIT=1 docker build --progress=plain -t "$IMAGE" "${extra[@]}" "$WORK/src" > "$WORK/build-$name.log" 2>&1
        rc=$?
    fi
    [ $rc -eq 0 ] || { tail -30 "$WORK/build-$name.log" >&2; return 1; }
    since "$t0"
}
steps_run() {  # the build steps of a log that ran (not taken from the cache), as a JSON list
    python3 - "$1" "$ENGINE" <<'PY'
import json, re, sys
lines = open(sys.argv[1], errors="replace").read().splitlines()
ran = []
if sys.argv[2] == "podman":  # buildah: "STEP n/m: INSTR", then "--> Using cache ID" when cached
    steps = [(i, re.sub(r"^\s*[\d.]+ ", "", line)) for i, line in enumerate(lines) if re.search(r"STEP \d+/\d+: ", line)]
    for k, (i, step) in enumerate(steps):
        end = steps[k + 1][0] if k + 1 < len(steps) else len(lines)
        body = lines[i + 1:end]
        if step.split(": ", 1)[1].startswith(("FROM", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "VOLUME",
                                             "HEALTHCHECK", "ENTRYPOINT", "CMD")):
            continue  # metadata: nothing to run
        if not any("Using cache" in line for line in body):
            ran.append(step.split(": ", 1)[1][:90])
else:  # BuildKit --progress=plain: "#N [stage k/m] INSTR" ... "#N CACHED"
    names, cached = {}, set()
    for line in lines:
        m = re.match(r"#(\d+) \[(.+?)\] (.*)", line)
        if m:
            names[m.group(1)] = f"[{m.group(2)}] {m.group(3)}"[:90]
        m = re.match(r"#(\d+) CACHED", line)
        if m:
            cached.add(m.group(1))
    ran = [name for n, name in names.items() if n not in cached and "internal" not in name and " FROM " not in f" {name}"]
print(json.dumps(ran))
PY
}

rm -rf "$WORK/src" && mkdir -p "$WORK/src"
if [ -n "${SRC:-}" ]; then
    cp -a "$SRC/." "$WORK/src/"
else
    git -C "$REPO" archive HEAD | tar -x -C "$WORK/src"
fi
COLD=null; WARM=null; RAN=null; RAN_COLD=null
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "cold build (no cache) of $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo "$SRC"); log $WORK/build-cold.log"
    COLD=$(build cold --no-cache) || { fail "cold build"; COLD=null; }
    RAN_COLD=$(steps_run "$WORK/build-cold.log" | python3 -c "import json,sys; print(len(json.load(sys.stdin)))")
    echo "# smoke test: a one-line edit ($(date -u +%FT%T))" >> "$WORK/src/vlmd/cli.py"
    say "build after a one-line edit of vlmd/cli.py; log $WORK/build-edit.log"
    WARM=$(build edit) || { fail "build after the edit"; WARM=null; }
    RAN=$(steps_run "$WORK/build-edit.log")
    say "steps run after the edit: $RAN"
fi
SIZE=$("${E[@]}" image inspect "$IMAGE" --format '{{.Size}}' 2>/dev/null || echo null)
# podman shows the image's HEALTHCHECK at the top level of its inspect output, docker under Config
HC_FIELD=$([ "$ENGINE" = podman ] && echo .HealthCheck || echo .Config.Healthcheck)
HEALTHCHECK=$("${E[@]}" image inspect "$IMAGE" --format "{{json $HC_FIELD}}" 2>/dev/null || echo null)

# --- run -------------------------------------------------------------------------------------
if python3 -c "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$PORT" 2>/dev/null; then :; else
    fail "port $PORT is taken on this host (set PORT)"
fi
MOUNT=(); ARGS=(--port "$PORT")
if [ -n "$MODEL_DIR" ]; then MOUNT=(-v "$(cd "$MODEL_DIR" && pwd):/model:ro"); ARGS+=(/model); fi
health() { python3 -c "import sys, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/health', timeout=2)" "$PORT" 2>/dev/null; }
start() {  # start NAME [run args]: a detached container of the image
    local name=$1; shift
    "${E[@]}" rm -f -v "$name" >/dev/null 2>&1
    "${E[@]}" run -d --name "$name" "${RUN_ARGS[@]}" "${MOUNT[@]}" "$@" "$IMAGE" "${ARGS[@]}" >/dev/null
}
wait_health() {  # wait_health NAME T0: seconds from T0 to a 200 on /health, or fails
    local i
    for i in $(seq 1 600); do
        health && { since "$2"; return 0; }
        [ "$("${E[@]}" inspect "$1" --format '{{.State.Running}}')" = true ] || break
        sleep 0.5
    done
    "${E[@]}" logs "$1" 2>&1 | tail -20 >&2
    return 1
}
stop() {  # stop NAME: SIGTERM (stop -t 30: SIGKILL after 30 s); prints {"seconds", "exit_code"}
    local t0 code
    t0=$(now)
    "${E[@]}" stop -t 30 "$1" >/dev/null
    local took; took=$(since "$t0")
    code=$("${E[@]}" inspect "$1" --format '{{.State.ExitCode}}')
    echo "{\"seconds\": $took, \"exit_code\": $code}"
}
chat() {  # one image chat through the API; prints a JSON summary, fails unless answered
    python3 - "$PORT" <<'PY'
import base64, json, struct, sys, urllib.request, zlib

base = f"http://127.0.0.1:{sys.argv[1]}"
def png(width, height):  # a red/blue gradient, encoded with the standard library
    rows = b"".join(b"\0" + bytes(c for x in range(width) for c in (255 * x // width, 0, 255 * y // height))
                    for y in range(height))
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
body = {"model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(64, 48)).decode()}}]}]}
request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
text = answer["choices"][0]["message"]["content"]
assert isinstance(text, str) and answer["usage"]["completion_tokens"] > 0, answer
print(json.dumps({"model": model, "finish_reason": answer["choices"][0]["finish_reason"],
                  "usage": {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")},
                  "content_chars": len(text)}))
PY
}
run_healthcheck() {  # the image's own HEALTHCHECK command, run in the container: its exit code
    python3 - "$HEALTHCHECK" <<'PY' > "$WORK/healthcheck.cmd"
import json, sys
test = (json.loads(sys.argv[1]) or {}).get("Test") or ["NONE"]
print("\0".join(test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else ["false"]), end="")
PY
    local cmd=()
    mapfile -d '' -t cmd < "$WORK/healthcheck.cmd"
    "${E[@]}" exec "$1" "${cmd[@]}" >&2
}

A='{}'; B='{}'; C='{}'
if [ ${#FAILED[@]} -eq 0 ] || [ "$SIZE" != null ]; then
    # A: its own user.
    say "A: start as the image's user"
    T0=$(now); start vlmd-smoke-a
    if START=$(wait_health vlmd-smoke-a "$T0"); then
        say "A: /health after ${START}s"
        CHAT=$(chat) || { fail "A: image chat"; CHAT=null; }
        run_healthcheck vlmd-smoke-a; HC=$?
        [ $HC -eq 0 ] || fail "A: HEALTHCHECK command exited $HC"
        HCRUN=null
        if [ "$ENGINE" = podman ]; then
            # podman's own runner of the HEALTHCHECK (exit code 0: healthy); without systemd it
            # cannot schedule the periodic checks and says so, but runs this one.
            "${E[@]}" healthcheck run vlmd-smoke-a >&2; HCRUN=$?
            [ "$HCRUN" -eq 0 ] || fail "A: podman healthcheck run exited $HCRUN"
        fi
        WHO=$("${E[@]}" exec vlmd-smoke-a id | python3 -c "import json,sys; print(json.dumps(sys.stdin.read().strip()))")
        PID1=$("${E[@]}" exec vlmd-smoke-a cat /proc/1/comm)
        STOP=$(stop vlmd-smoke-a)
        python3 -c "import json,sys; s = json.loads(sys.argv[1]); sys.exit(s['exit_code'] != 0 or s['seconds'] > 10)" "$STOP" \
            || fail "A: SIGTERM once ready: $STOP"
        A=$(python3 -c "import json,sys; print(json.dumps(dict(start_to_health_s=float(sys.argv[1]), chat=json.loads(sys.argv[2]),
            healthcheck_cmd_rc=int(sys.argv[3]), podman_healthcheck_run_rc=json.loads(sys.argv[4]), id=json.loads(sys.argv[5]),
            pid1=sys.argv[6], sigterm_when_ready=json.loads(sys.argv[7]))))" "$START" "$CHAT" "$HC" "$HCRUN" "$WHO" "$PID1" "$STOP")
    else
        fail "A: no /health"
    fi
    "${E[@]}" logs vlmd-smoke-a > "$WORK/a.log" 2>&1; "${E[@]}" rm -f -v vlmd-smoke-a >/dev/null 2>&1

    # B: SIGTERM while loading: at the server's first log line (building the tiny model, or
    # loading the checkpoint), with /health not answering yet.
    say "B: SIGTERM during load"
    T0=$(now); start vlmd-smoke-b
    PHASE=""
    for i in $(seq 1 600); do
        PHASE=$("${E[@]}" logs vlmd-smoke-b 2>&1 | grep -m1 -oE 'building the embedded default model|loading|ready' || true)
        [ -n "$PHASE" ] && break
        sleep 0.2
    done
    AT=$(since "$T0")
    if [ "$PHASE" = ready ] || health; then
        fail "B: the server was ready before SIGTERM could be sent during load"
    fi
    STOP=$(stop vlmd-smoke-b)
    READY_AFTER=$("${E[@]}" logs vlmd-smoke-b 2>&1 | grep -c '"ready"\| ready ' || true)
    python3 -c "import json,sys; s = json.loads(sys.argv[1]); sys.exit(s['seconds'] > 10 or s['exit_code'] == 137)" "$STOP" \
        || fail "B: SIGTERM during load: $STOP"
    B=$(python3 -c "import json,sys; print(json.dumps(dict(sent_at_s=float(sys.argv[1]), phase=sys.argv[2], sigterm_during_load=json.loads(sys.argv[3]),
        ready_lines=int(sys.argv[4]))))" "$AT" "$PHASE" "$STOP" "$READY_AFTER")
    "${E[@]}" logs vlmd-smoke-b > "$WORK/b.log" 2>&1; "${E[@]}" rm -f -v vlmd-smoke-b >/dev/null 2>&1

    # C: an arbitrary UID in the root group.
    say "C: start as --user 12345:0"
    T0=$(now); start vlmd-smoke-c --user 12345:0
    if START=$(wait_health vlmd-smoke-c "$T0"); then
        say "C: /health after ${START}s"
        CHAT=$(chat) || { fail "C: image chat as 12345:0"; CHAT=null; }
        WHO=$("${E[@]}" exec vlmd-smoke-c id | python3 -c "import json,sys; print(json.dumps(sys.stdin.read().strip()))")
        FILES=$("${E[@]}" exec vlmd-smoke-c sh -c 'stat -c "%u:%g %a %n" "$VLMD_CACHE_DIR" "$VLMD_CACHE_DIR"/models/* && touch "$HOME/.w" "$VLMD_CACHE_DIR/.w" && echo "HOME=$HOME writable"' 2>&1 \
                | python3 -c "import json,sys; print(json.dumps(sys.stdin.read().strip().splitlines()))")
        "${E[@]}" exec vlmd-smoke-c sh -c 'touch "$HOME/.w" "$VLMD_CACHE_DIR/.w"' || fail "C: HOME or the cache not writable"
        STOP=$(stop vlmd-smoke-c)
        python3 -c "import json,sys; s = json.loads(sys.argv[1]); sys.exit(s['exit_code'] != 0 or s['seconds'] > 10)" "$STOP" \
            || fail "C: SIGTERM: $STOP"
        C=$(python3 -c "import json,sys; print(json.dumps(dict(start_to_health_s=float(sys.argv[1]), chat=json.loads(sys.argv[2]),
            id=json.loads(sys.argv[3]), files=json.loads(sys.argv[4]), sigterm_when_ready=json.loads(sys.argv[5]))))" \
            "$START" "$CHAT" "$WHO" "$FILES" "$STOP")
    else
        fail "C: no /health as --user 12345:0"
    fi
    "${E[@]}" logs vlmd-smoke-c > "$WORK/c.log" 2>&1; "${E[@]}" rm -f -v vlmd-smoke-c >/dev/null 2>&1
fi

python3 - "$IMAGE" "$SIZE" "$COLD" "$RAN_COLD" "$WARM" "$RAN" "$A" "$B" "$C" "$MODEL_DIR" "$ENGINE" "$WORK" "${FAILED[@]}" <<'PY'
import json, sys
(image, size, cold, ran_cold, warm, ran, a, b, c, model, engine, work), failed = sys.argv[1:13], sys.argv[13:]
size = None if size == "null" else int(size)
print(json.dumps({
    "ok": not failed, "failed": failed, "engine": engine, "image": image,
    "image_size_bytes": size, "image_size_gb": size and round(size / 1e9, 2),
    "build_cold_s": json.loads(cold), "build_cold_steps_run": json.loads(ran_cold),
    "build_after_one_line_edit_s": json.loads(warm), "steps_run_after_edit": json.loads(ran),
    "model": model or "built-in tiny", "run_own_user": json.loads(a), "sigterm_during_load": json.loads(b),
    "run_user_12345_0": json.loads(c), "logs": work}))
PY
[ ${#FAILED[@]} -eq 0 ]
