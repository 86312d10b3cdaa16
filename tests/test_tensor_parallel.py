"""Tensor parallelism through the real server: ``--tensor-parallel-size 2`` (gloo, one thread
per rank) answers as transformers does, on one host and on two simulated "hosts"; a rank
that dies or hangs fails the server clearly and within a bounded time.

Each parity server combines the hard regimes in one start (starting rank processes costs
seconds on this machine): concurrent requests, a token budget that splits prompts and
images across steps, and a KV cache small enough to preempt. A first divergence is accepted
only where transformers' own top-1/top-2 gap is below 1e-3 (the all-reduce sums partial
products in another order than one matmul does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from conftest import Server, free_port, image_message, random_image
from oracle import assert_chat_parity, assert_greedy_match, hf_llava_generate
from test_qwen2_vl import CASE_NAMES, NUM_FRAMES, SERVER_MAX_PIXELS, _body, _cases, _max_tokens, _reference
from test_qwen2_vl import video_file  # noqa: F401  (a fixture)
from whisper_support import hf_whisper_generate, load_hf_whisper, post_audio, read_samples, wav_bytes

TP2 = ("--tensor-parallel-size", "2", "--torch-threads", "1")

LLAVA_CASES = [
    ("What is in this image?", (640, 480), 12),
    ("Describe the picture in detail.", (480, 640), 24),
    ("Is there a cat?", None, 16),
    ("Write a caption.", (336, 336), 30),
    ("Count the objects.", (96, 128), 20),
    ("Where was this taken?", (1024, 768), 10),
]


def _llava_case(index: int):
    prompt, size, max_tokens = LLAVA_CASES[index]
    images = [] if size is None else [random_image(200 + index, *size)]
    return prompt, images, max_tokens


def _llava_reference(model_dir, index: int):
    prompt, images, max_tokens = _llava_case(index)
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    return hf_llava_generate(model_dir, [{"role": "user", "content": parts}], images, max_tokens)


def _llava_chat(server: Server, index: int) -> dict:
    prompt, images, max_tokens = _llava_case(index)
    status, body = server.chat({"messages": image_message(prompt, *images), "max_tokens": max_tokens,
                                "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    return body


def _check_llava(bodies, refs) -> None:
    for body, ref in zip(bodies, refs):
        assert body["prompt_token_ids"] == ref["prompt_token_ids"]
        assert_greedy_match(body["choices"][0]["token_ids"], ref)


@pytest.fixture(scope="module")
def llava_references(tiny_llava_dir):
    return [_llava_reference(tiny_llava_dir, index) for index in range(len(LLAVA_CASES))]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _rank_pid(server: Server) -> int:
    ranks = [pid for pid in _children(server.process.pid)
             if b"vlmd.engine.rank_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(ranks) == 1, ranks
    return ranks[0]


def test_llava_tp2_concurrent_chunked_preempted_and_cached(tiny_llava_dir, llava_references, tmp_path):
    # 76 blocks x 16 = 1216 tokens: two ~590-token image prompts fit, their decodes do not;
    # 200 tokens a step split each image's 576 placeholders over 3+ steps.
    server = Server(tiny_llava_dir, *TP2, "--num-kv-blocks", "76", "--max-model-len", "1216",
                    "--max-num-batched-tokens", "200", log_dir=tmp_path)
    try:
        rank = _rank_pid(server)
        for _ in range(3):  # preemption depends on arrival timing: retry until one happened
            with ThreadPoolExecutor(len(LLAVA_CASES)) as pool:
                bodies = list(pool.map(lambda index: _llava_chat(server, index), range(len(LLAVA_CASES))))
            _check_llava(bodies, llava_references)
            metrics = server.metrics()
            if metrics["vlmd_num_preemptions_total"] > 0:
                break
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        assert metrics["vlmd_kv_cache_free_blocks"] == metrics["vlmd_kv_cache_total_blocks"]

        # The same image twice in a row: the prefix cache and the encoder cache both hit.
        _llava_chat(server, 0)
        before = server.metrics()
        again = _llava_chat(server, 0)
        after = server.metrics()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert after["vlmd_encoder_forwards_total"] == before["vlmd_encoder_forwards_total"]
        assert after["vlmd_encoder_cache_hits_total"] > before["vlmd_encoder_cache_hits_total"]
        _check_llava([again], llava_references[:1])
    finally:
        server.stop()
    assert server.process.returncode == 0
    assert not os.path.exists(f"/proc/{rank}") or _zombie(rank), "shutdown must end every rank"
    log = server.log_path.read_text()
    assert '"tensor-parallel rank shutting down"' in log and '"rank": 1' in log


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_qwen2_vl_tp2_images_and_video(tiny_qwen2_vl_dir, media_dir, video_file, tmp_path):  # noqa: F811
    cases = list(_cases(video_file).items())
    server = Server(
        tiny_qwen2_vl_dir, *TP2, "--allowed-local-media-path", str(media_dir),
        "--limit-mm-per-prompt", "image=3,video=1", "--max-num-batched-tokens", "32", "--num-kv-blocks", "20",
        "--max-model-len", "320", "--mm-processor-kwargs", orjson.dumps({"max_pixels": SERVER_MAX_PIXELS}).decode(),
        "--media-io-kwargs", orjson.dumps({"video": {"num_frames": NUM_FRAMES}}).decode(), log_dir=tmp_path,
    )
    try:
        def one(index):
            status, body = server.chat(_body(*cases[index][1], _max_tokens(index)))
            assert status == 200, body
            return body

        with ThreadPoolExecutor(len(cases)) as pool:
            bodies = list(pool.map(one, range(len(cases))))
        for index, ((name, (parts, text, kwargs)), body) in enumerate(zip(cases, bodies)):
            merged = {"max_pixels": SERVER_MAX_PIXELS, **kwargs}
            assert_chat_parity(body, _reference(tiny_qwen2_vl_dir, parts, text, merged, _max_tokens(index)))
        assert server.metrics()["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        assert "video_file_url" in CASE_NAMES
    finally:
        server.stop()


def _tones(index: int, seconds: float):
    import numpy as np

    t = np.arange(int(16000 * seconds)) / 16000
    signal_ = 0.3 * np.sin(2 * np.pi * (200 + 500 * index) * t) * np.sin(2 * np.pi * t * (index + 1))
    return wav_bytes(signal_.astype(np.float32))


def test_whisper_tp2_concurrent_chunked_preempted(tiny_whisper_dir, tmp_path):
    # 290 blocks of 16 for 6 windows, each 94 of cross-attention K/V and up to 4 of text: three
    # get in, then grow past what is left; 3 tokens a step split prompts.
    server = Server(tiny_whisper_dir, *TP2, "--num-kv-blocks", "290", "--max-num-seqs", "8",
                    "--max-num-batched-tokens", "3", name="tiny-whisper", log_dir=tmp_path)
    try:
        clips = [_tones(index, 3.0 + 5 * index) for index in range(6)]
        fields = [{"language": language} for language in ("en", "fr", "de", "es", "en", "fr")]
        with ThreadPoolExecutor(len(clips)) as pool:
            answers = list(pool.map(lambda args: post_audio(server, *args), zip(fields, clips)))
        _, processor = load_hf_whisper(str(tiny_whisper_dir.resolve()))
        for (status, body), field, clip in zip(answers, fields, clips):
            assert status == 200, body
            reference = hf_whisper_generate(tiny_whisper_dir, read_samples(clip), language=field["language"],
                                            task="transcribe")
            expected = processor.tokenizer.decode(reference["output_token_ids"], skip_special_tokens=True).strip()
            assert orjson.loads(body)["text"] == expected
        metrics = server.metrics()
        assert metrics["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        # Every window's cross-attention blocks (1,500 frames: 94 blocks of 16) came from the one
        # pool and came back, the preempted ones' included (D93, D95).
        cross = '{group="1",kind="cross_attention",window=""}'
        assert metrics["vlmd_kv_cache_group_peak_request_blocks" + cross] == 94
        assert metrics["vlmd_kv_cache_group_blocks" + cross] == 0
        assert metrics["vlmd_kv_cache_free_blocks"] == metrics["vlmd_kv_cache_total_blocks"] == 290
    finally:
        server.stop()


def test_two_hosts_on_loopback_answer_the_same(tiny_llava_dir, llava_references, tmp_path):
    """Node 0 serves HTTP and runs rank 0; node 1 is a second ``vlmd serve`` running rank 1 only."""
    port = free_port()
    hosts = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    log = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "vlmd", "serve", str(tiny_llava_dir), *TP2, *hosts, "--node-rank", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        server = Server(tiny_llava_dir, *TP2, *hosts, "--node-rank", "0", log_dir=tmp_path)
        try:
            with ThreadPoolExecutor(3) as pool:
                bodies = list(pool.map(lambda index: _llava_chat(server, index), range(3)))
            _check_llava(bodies, llava_references[:3])
        finally:
            server.stop()
        assert node1.wait(30) == 0  # node 0's shutdown ends node 1's rank, and node 1 with it
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()
    text = (tmp_path / "node1.log").read_text()
    assert "node running ranks only (no HTTP)" in text and '"tensor-parallel rank shutting down"' in text


def _long_request(server: Server, results: list) -> None:
    started = time.monotonic()
    status, body = server.chat({"messages": [{"role": "user", "content": "tell me everything"}],
                                "max_tokens": 1500, "min_tokens": 1500, "temperature": 0}, timeout=60)
    results.append((status, body, time.monotonic() - started))


def _start_long_request(server: Server) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=_long_request, args=(server, results))
    thread.start()
    deadline = time.monotonic() + 30
    while server.metrics().get("vlmd_num_requests_running", 0) < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    return thread, results


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_fails_the_server_clearly_and_quickly(tiny_llava_dir, tmp_path, how):
    timeout_s = 3
    server = Server(tiny_llava_dir, *TP2, "--distributed-timeout-s", str(timeout_s), log_dir=tmp_path)
    rank = _rank_pid(server)
    try:
        thread, results = _start_long_request(server)
        lost = time.monotonic()
        os.kill(rank, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        thread.join(30)
        status, body, _ = results[0]
        noticed = time.monotonic() - lost
        assert status == 500 and body["error"]["type"] == "server_error", body
        message = body["error"]["message"]
        if how == "killed":
            assert "tensor-parallel rank 1" in message and "signal 9" in message, message
            assert noticed < 5, noticed
        else:
            assert f"did not answer within {timeout_s} s" in message, message
            assert noticed < timeout_s + 5, noticed
        code = server.process.wait(20)  # exits by itself, non-zero
        assert code == 1, code
        assert time.monotonic() - lost < timeout_s + 15
    finally:
        if how == "hung" and os.path.exists(f"/proc/{rank}"):
            os.kill(rank, signal.SIGKILL)
        server.stop()
    log = server.log_path.read_text()
    assert '"tensor-parallel rank failed; the server stops"' in log
    assert '"exiting after a tensor-parallel failure"' in log
    if how == "killed":
        assert "tensor-parallel rank 1 (pid" in log


def test_health_turns_503_when_a_rank_dies_while_idle(tiny_llava_dir, tmp_path):
    server = Server(tiny_llava_dir, *TP2, log_dir=tmp_path)
    try:
        os.kill(_rank_pid(server), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:
            try:
                status, raw = server.request("GET", "/health", timeout=2)
            except OSError:  # already exited: too late to see the 503, the exit code says it
                status, raw = None, b""
                break
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if status is not None:
            assert status == 503 and b"tensor-parallel rank 1" in raw, (status, raw)
        assert server.process.wait(15) == 1
    finally:
        server.stop()


def test_a_poisoned_request_fails_alone_under_tp2(tiny_llava_dir, tmp_path):
    """A step that raises on every rank is re-run over parts of it on every rank (the re-runs
    are messages too), so the culprit fails alone and the ranks stay in step."""
    from test_fault_isolation_server import FAULTS, FLAGS
    from test_fault_isolation_server import (
        test_poisoned_requests_fail_alone_and_good_ones_match_transformers as poisoned_requests_fail_alone,
    )

    server = Server(tiny_llava_dir, *TP2, *FLAGS, faults=FAULTS, log_dir=tmp_path)
    try:
        poisoned_requests_fail_alone(server, tiny_llava_dir)
        assert server.request("GET", "/health")[0] == 200
        _check_llava([_llava_chat(server, 2)], [_llava_reference(tiny_llava_dir, 2)])
    finally:
        server.stop()
    assert '"step failed on this rank as on rank 0"' in server.log_path.read_text()
