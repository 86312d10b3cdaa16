"""``vlmd cost`` equals what the server reports for the same inputs.

Chat models: ``usage.prompt_tokens`` of a real request through the HTTP server. Whisper's
transcription usage is its duration, so there the server's own count of prompt tokens
(``vlmd_prompt_tokens_total`` in /metrics) and of encoder forwards (windows) are compared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import Server, image_message, make_video, random_image, video_data_url
from whisper_support import post_audio, wav_bytes
from vlmd.cost import CostOptions, ItemSpec, audio_clip, compute_cost, parse_image, parse_video


def _usage_prompt_tokens(server, messages) -> int:
    status, body = server.chat({"messages": messages, "max_tokens": 1})
    assert status == 200, body
    return body["usage"]["prompt_tokens"]


def test_parse_sizes():
    assert parse_image("640x480").size.width == 640
    video = parse_video("2.5sx640x480", fps=4)
    assert (video.source_frames, video.size.height) == (10, 480)
    assert parse_video("48x112x84", fps=30).source_frames == 48
    for bad in ("640", "x480", "640x480x"):
        with pytest.raises(ValueError, match="--image"):
            parse_image(bad)
    with pytest.raises(ValueError, match="--video"):
        parse_video("640x480", fps=30)


def test_llava_prompt_tokens_equal_the_servers(llava_server, tiny_llava_dir):
    messages = image_message("What is here?", random_image(1, 640, 480), random_image(2, 100, 60))
    report = compute_cost(str(tiny_llava_dir), [parse_image("640x480"), parse_image("100x60")],
                          CostOptions(prompt="What is here?"))
    assert [row["placeholder_tokens"] for row in report["items"]] == [576, 576]
    assert report["prompt_tokens"] == _usage_prompt_tokens(llava_server, messages)
    # KV: block-rounded prompt, layers x kv heads x head dim x 2 x 4 bytes per token.
    request = report["requests"][0]
    assert request["kv_blocks"] == -(-report["prompt_tokens"] // 16)
    assert request["kv_bytes"] == request["kv_blocks"] * 16 * report["kv_bytes_per_token"]


def test_the_cli_prints_the_same_json(tiny_llava_dir):
    raw = subprocess.run(
        [sys.executable, "-m", "vlmd", "cost", str(tiny_llava_dir), "--image", "640x480", "--json",
         "--num-kv-blocks", "1000", "--max-tokens", "10"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout
    report = json.loads(raw)
    expected = compute_cost(str(tiny_llava_dir), [parse_image("640x480")], CostOptions(num_kv_blocks=1000, max_tokens=10))
    assert report == expected
    assert report["cache"]["requests_held"] == 1000 // report["requests"][0]["kv_blocks"]


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen2_vl_dir, tmp_path_factory):
    server = Server(tiny_qwen2_vl_dir, "--max-model-len", "4096",
                    "--media-io-kwargs", '{"video": {"num_frames": 6}}', "--mm-processor-kwargs",
                    '{"max_pixels": 50176}', log_dir=tmp_path_factory.mktemp("cost-qwen-logs"))
    yield server
    server.stop()


def _qwen_cost(model_dir, items) -> dict:
    options = CostOptions(prompt="What is here?", media_io_kwargs={"video": {"num_frames": 6}},
                          mm_processor_kwargs={"max_pixels": 50176})
    return compute_cost(str(model_dir), items, options)


def test_qwen2_vl_image_prompt_tokens_equal_the_servers(qwen_server, tiny_qwen2_vl_dir):
    messages = image_message("What is here?", random_image(3, 640, 480), random_image(4, 57, 300))
    report = _qwen_cost(tiny_qwen2_vl_dir, [parse_image("640x480"), parse_image("57x300")])
    assert len({row["placeholder_tokens"] for row in report["items"]}) == 2  # sizes matter here
    assert report["prompt_tokens"] == _usage_prompt_tokens(qwen_server, messages)


def test_qwen2_vl_video_prompt_tokens_equal_the_servers(qwen_server, tiny_qwen2_vl_dir):
    for frames, width, height in ((9, 112, 84), (3, 200, 120)):
        video = {"type": "video_url", "video_url": {"url": video_data_url(make_video(frames, width, height))}}
        messages = [{"role": "user", "content": [video, {"type": "text", "text": "What is here?"}]}]
        report = _qwen_cost(tiny_qwen2_vl_dir, [parse_video(f"{frames}x{width}x{height}", fps=4)])
        assert report["items"][0]["frames"] == min(6, frames - frames % 2)
        assert report["prompt_tokens"] == _usage_prompt_tokens(qwen_server, messages)


def test_whisper_prompt_tokens_and_windows_equal_the_servers(whisper_server, tiny_whisper_dir):
    rng = np.random.default_rng(13)
    # Thresholds off: no window is re-decoded at a higher temperature (a retry re-sends its
    # prompt, which no cost can foresee); each window is still scored for silence.
    no_retries = {"compression_ratio_threshold": "none", "logprob_threshold": "none"}
    for seconds, fields in ((12.0, {"language": "en"}), (12.0, {}), (41.0, {"language": "en"})):
        before = whisper_server.metrics()
        samples = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
        status, body = post_audio(whisper_server, {**fields, **no_retries}, wav_bytes(samples))
        assert status == 200, body
        after = whisper_server.metrics()
        report = compute_cost(str(tiny_whisper_dir), [audio_clip(seconds)], CostOptions(language=fields.get("language")))
        window = next(r for r in report["requests"] if r["request"] == "transcription window")
        probe = next(r for r in report["requests"] if r["request"] == "no-speech probe")
        # The probe is a request of its own on the same window: it shares the window's encoder
        # output when both are in one step, and runs the encoder again when not.
        forwards = after["vlmd_encoder_forwards_total"] - before["vlmd_encoder_forwards_total"]
        assert window["windows"] <= forwards <= 2 * window["windows_max"]
        detection = sum(r["prompt_tokens"] for r in report["requests"] if r["request"] == "language detection")
        served = after["vlmd_prompt_tokens_total"] - before["vlmd_prompt_tokens_total"]
        per_window = window["prompt_tokens"] + probe["prompt_tokens"]
        assert (served - detection) % per_window == 0
        assert window["windows"] <= (served - detection) // per_window <= window["windows_max"]
        if seconds <= 30:
            assert served == report["prompt_tokens"]
        assert report["items"][0]["encoder_tokens"] == 1500


def test_a_speech_model_takes_one_clip(tiny_whisper_dir):
    with pytest.raises(ValueError, match="one --audio-seconds clip"):
        compute_cost(str(tiny_whisper_dir), [audio_clip(5), audio_clip(6)], CostOptions())
    assert isinstance(audio_clip(1.5), ItemSpec)


def test_a_directory_that_is_not_a_checkpoint_is_a_one_line_error(tmp_path):
    for path, fragment in ((tmp_path / "missing", "does not exist"), (tmp_path, "has no config.json")):
        done = subprocess.run([sys.executable, "-m", "vlmd", "cost", str(path), "--image", "640x480"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("vlmd cost: MODEL_DIR")
        assert fragment in done.stderr and "Traceback" not in done.stderr


def test_an_item_the_model_does_not_take_is_an_error_naming_what_it_takes(tiny_llava_dir):
    with pytest.raises(ValueError, match=r"this model takes no audio \(it takes: image\)"):
        compute_cost(str(tiny_llava_dir), [audio_clip(5)], CostOptions())


def test_a_config_only_directory_needs_no_weights_or_tokenizer():
    from conftest import REPO

    report = compute_cost(str(REPO / "docs/examples/llava-1.5-7b-config"), [parse_image("640x480")],
                          CostOptions(dtype="float16", memory_gb=80, memory_utilization=0.9, activation_gb=1,
                                      max_tokens=512))
    assert report["kv_bytes_per_token"] == 32 * 32 * 128 * 2 * 2
    assert report["prompt_tokens"] == 576  # media only: no tokenizer to count the text
    cache = report["cache"]
    assert 7.0e9 < cache["weight_bytes"] / 2 < 7.1e9  # LLaVA-1.5-7B (CLIP's last layer is never built)
    left = int(80 * 2**30 * 0.9) - cache["weight_bytes"] - 2**30 - cache["encoder_cache_bytes"]
    assert cache["num_kv_blocks"] == left // (16 * report["kv_bytes_per_token"])
    assert cache["requests_held"] == cache["num_kv_blocks"] // report["requests"][0]["kv_blocks"]
    assert cache["full_length_requests"] == cache["num_kv_blocks"] // (4096 // 16)


def test_the_settings_cost_shares_with_serve_are_serve_s():
    """--dtype, --block-size, --kv-cache-gb, --max-num-batched-tokens, ...: one definition
    (vlmd/config.py:ServeConfig) for both commands' flags and for ``CostOptions``."""
    from vlmd.cli import _parser
    from vlmd.config import serve_setting, setting_default
    from vlmd.cost import _DTYPE_BYTES, SHARED_SERVE_SETTINGS

    _, commands = _parser()
    cost_flags = {action.dest: action for action in commands["cost"]._actions}
    serve_flags = {action.dest: action for action in commands["serve"]._actions}
    options = CostOptions()
    assert {"dtype", "block_size", "kv_cache_gb", "max_num_batched_tokens"} <= set(SHARED_SERVE_SETTINGS)
    for name in SHARED_SERVE_SETTINGS:
        spec = serve_setting(name)
        cost, serve = cost_flags[name], serve_flags[name]
        assert cost.default == serve.default == setting_default(spec) == getattr(options, name), name
        assert (cost.option_strings, cost.help, cost.choices) == (serve.option_strings, serve.help, serve.choices), name
        assert cost.choices == spec.metadata["choices"], name
    assert set(_DTYPE_BYTES) == set(serve_setting("dtype").metadata["choices"])


def test_the_cache_is_sized_in_the_server_s_order():
    """--num-kv-blocks, then --kv-cache-gb, then --memory-gb's plan, else a CPU server's default."""
    from conftest import REPO
    from vlmd.config import DEFAULT_CPU_KV_CACHE_GB

    model = str(REPO / "docs/examples/llava-1.5-7b-config")
    items = [parse_image("640x480")]
    default = compute_cost(model, items, CostOptions())
    block_bytes = 16 * default["kv_bytes_per_token"]
    assert default["cache"]["source"] == "kv-cache-gb"
    assert default["cache"]["num_kv_blocks"] == int(DEFAULT_CPU_KV_CACHE_GB * 2**30) // block_bytes
    given = compute_cost(model, items, CostOptions(kv_cache_gb=2, memory_gb=80))
    assert (given["cache"]["source"], given["cache"]["num_kv_blocks"]) == ("kv-cache-gb", 2 * 2**30 // block_bytes)
    assert compute_cost(model, items, CostOptions(memory_gb=80))["cache"]["source"] == "utilization"
