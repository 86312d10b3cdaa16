"""The start-up memory plan: the profile's peak shrinks the KV cache; items that can never
fit are start-up errors; a modality limited to 0 loses its encoder; explicit sizes win."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import Server, free_port, image_message, random_image, server_device_flags
from vlmd.engine.memory_plan import GIB, MemoryPlan, check_holds_one_sequence, kv_budget_bytes
from vlmd.sched.kv_spec import FullAttention, build_kv_cache_config
from vlmd.types import KVSpec


def test_budget_arithmetic_and_its_error():
    assert kv_budget_bytes(100 * GIB, 0.5, 10 * GIB, 5 * GIB, 1 * GIB) == 34 * GIB
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        kv_budget_bytes(10 * GIB, 0.5, 4 * GIB, 1 * GIB, 1 * GIB)
    with pytest.raises(ValueError, match="utilisation"):
        kv_budget_bytes(10 * GIB, 1.5, 0, 0, 0)
    kv = build_kv_cache_config([FullAttention()] * 4, 16, 1000, slot_bytes=2048)
    plan = MemoryPlan("cpu", "kv-cache-gb", 0, 0.0, 1, 1, 1, 0, 0, kv, 2048, 40)
    assert plan.max_full_length_requests == 1000 // 128
    assert plan.kv_bytes == 1000 * 8192 and plan.kv_bytes_per_block == 8192


def test_every_group_is_paid_from_one_pool():
    """Sliding windows and full attention (D95): no group reserved for its worst case; the plan
    states what a request of max_model_len holds in each group and how many fit."""
    spec = KVSpec(4, 2, 16, (24, None, 24, None))
    kv = spec.kv_cache_config(16, 4, max_model_len=1024, max_num_batched_tokens=40, num_blocks=690)
    assert kv.num_slots == 2 and kv.page_bytes == 2 * (2 * 16 * 2 * 16 * 4)  # two layers a page
    plan = MemoryPlan("cpu", "num-kv-blocks", 0, 0.0, 1, 1, 1, 0, 0, kv, 1024, 40)
    rows = plan.group_rows()
    assert [(row["kind"], row.get("window")) for row in rows] == [("full_attention", None), ("sliding_window", 24)]
    assert [row["full_length_request_blocks"] for row in rows] == [64, 2]
    assert [row["peak_request_blocks"] for row in rows] == [64, (40 + 24 + 32 - 3) // 16]
    assert plan.max_full_length_requests == 690 // 66 == 10
    assert plan.fields()["max_concurrency"] == round(690 / 66, 2)
    assert plan.kv_bytes == 690 * kv.page_bytes
    check_holds_one_sequence(kv.with_blocks(69), 1024, 40, "num-kv-blocks")
    with pytest.raises(ValueError, match="needs 69 across its KV groups"):
        check_holds_one_sequence(kv.with_blocks(68), 1024, 40, "num-kv-blocks")


def _plan(server) -> dict[str, float]:
    return {name: value for name, value in server.metrics().items() if name.startswith("vlmd_memory_plan")}


def _bytes(plan: dict, part: str) -> float:
    (value,) = [v for name, v in plan.items() if f'part="{part}"' in name]
    return value


def test_the_kv_cache_shrinks_when_the_encoder_peak_grows(tiny_qwen2_vl_dir, tmp_path):
    plans = {}
    # The encoder budget bounds encoder work per step, so only an item larger than the budget
    # (here 512 tokens, raised to fit a 2,970-token image) raises the worst case.
    for max_pixels in (64 * 28 * 28, 3000 * 28 * 28):
        server = Server(
            tiny_qwen2_vl_dir, "--memory-utilization", "0.1", "--mm-processor-cache-gb", "0.05",
            "--max-num-batched-tokens", "512", "--max-model-len", "4096",
            "--limit-mm-per-prompt", "video=0", "--mm-processor-kwargs", f'{{"max_pixels": {max_pixels}}}',
            "--no-warmup", kv_cache_gb=None, log_dir=tmp_path,
        )
        try:
            plans[max_pixels] = _plan(server)
        finally:
            server.stop()
    small, large = plans[64 * 28 * 28], plans[3000 * 28 * 28]
    assert any('source="utilization"' in name for name in small)
    assert _bytes(large, "encoder_peak") > _bytes(small, "encoder_peak") + 20 * 2**20
    assert _bytes(large, "activations") > _bytes(small, "activations")
    assert large["vlmd_memory_plan_kv_blocks"] < small["vlmd_memory_plan_kv_blocks"]
    # The plan adds up: total x utilisation - base - activations - encoder cache = KV (to a block).
    for plan in (small, large):
        left = _bytes(plan, "total") * 0.1 - _bytes(plan, "base") - _bytes(plan, "activations") - _bytes(plan, "encoder_cache")
        per_block = _bytes(plan, "kv_cache") / plan["vlmd_memory_plan_kv_blocks"]
        assert -1 <= left - _bytes(plan, "kv_cache") < per_block + 1


def _serve_fails(model_dir, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "vlmd", "serve", str(model_dir), "--port", str(free_port()), *server_device_flags(), *flags],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    return result.stderr


def test_an_item_that_cannot_fit_max_model_len_is_a_start_up_error(tiny_qwen2_vl_dir):
    message = _serve_fails(tiny_qwen2_vl_dir, "--max-model-len", "4096", "--mm-processor-kwargs",
                           '{"max_pixels": 1003520}', "--media-io-kwargs", '{"video": {"num_frames": 32}}')
    assert "the largest video this server accepts takes" in message
    assert "max_model_len 4096" in message and "--limit-mm-per-prompt video=0" in message
    assert "--max-model-len" in message and "num_frames in --media-io-kwargs" in message


def test_an_item_over_an_explicit_encoder_budget_is_a_start_up_error(tiny_llava_dir):
    message = _serve_fails(tiny_llava_dir, "--max-num-encoder-input-tokens", "100")
    assert "the largest image this server accepts needs 576 encoder tokens, more than " \
           "--max-num-encoder-input-tokens 100" in message


def test_a_limit_of_zero_drops_the_encoder(tiny_llava_dir, tmp_path):
    # Plain kernels on both servers: timed kernel choices may keep a packed copy of some
    # weights, which would make the two weight figures differ by more than the encoder.
    with_images_server = Server(tiny_llava_dir, "--linear-kernels", "plain", "--no-warmup", log_dir=tmp_path)
    try:
        with_images = _plan(with_images_server)
    finally:
        with_images_server.stop()
    server = Server(tiny_llava_dir, "--limit-mm-per-prompt", "image=0", "--linear-kernels", "plain",
                    log_dir=tmp_path)
    try:
        status, body = server.chat({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
        assert status == 200, body
        status, body = server.chat({"messages": image_message("hi", random_image(0)), "max_tokens": 2})
        assert status == 400 and "--limit-mm-per-prompt" in body["error"]["message"]
        text_only = _plan(server)
    finally:
        server.stop()
    assert _bytes(text_only, "weights") < _bytes(with_images, "weights")
    assert _bytes(text_only, "encoder_peak") == 0


def test_explicit_kv_sizes_win(llava_server):
    plan = _plan(llava_server)  # started with --kv-cache-gb 0.25
    assert any('source="kv-cache-gb"' in name for name in plan)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # K and V x 2 layers x 2 kv heads x head dim 16 x float32 x 16 tokens
    assert _bytes(plan, "kv_cache") == plan["vlmd_memory_plan_kv_blocks"] * per_block
    assert plan["vlmd_memory_plan_kv_blocks"] == int(0.25 * GIB // per_block)
