"""``vlmd`` on the command line: flags generated from the settings, clear one-line errors
before any model loads, a custom chat template, and the lines an operator reads."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import fields

import pytest

from conftest import Server, image_message, random_image
from vlmd.cli import _parser
from vlmd.cli_flags import config_from_flags
from vlmd.config import ServeConfig


def vlmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmd", *args], capture_output=True, text=True, timeout=timeout)


def test_every_setting_is_a_flag_with_its_default_in_help():
    help_text = " ".join(vlmd("serve", "--help").stdout.split())
    for spec in fields(ServeConfig):
        if spec.name == "model":
            assert "MODEL_DIR" in help_text
            continue
        flag = "--" + spec.name.replace("_", "-")
        assert flag in help_text, flag
    assert help_text.count("(default:") >= len(fields(ServeConfig)) - 1
    assert "--max-num-batched-tokens N token budget of one step (prefill chunks + decodes) (default: 2048)" in help_text


def test_flag_defaults_equal_the_settings_defaults():
    parser, _ = _parser()
    args = parser.parse_args(["serve", "some/dir"])
    assert config_from_flags(args, model="some/dir") == ServeConfig(model="some/dir")


def test_flags_parse_into_settings():
    parser, _ = _parser()
    args = parser.parse_args([
        "serve", "m", "--limit-mm-per-prompt", "image=2,video=1", "--allowed-media-domains", "a.com, b.org",
        "--mm-processor-kwargs", '{"max_pixels": 100352}', "--no-enable-prefix-caching", "--no-warmup",
        "--kv-cache-gb", "0.5",
    ])
    config = config_from_flags(args, model="m")
    assert config.limit_mm_per_prompt == {"image": 2, "video": 1}
    assert config.allowed_media_domains == ("a.com", "b.org")
    assert config.mm_processor_kwargs == {"max_pixels": 100352}
    assert config.enable_prefix_caching is False and config.warmup is False
    assert config.kv_cache_gb == 0.5


def test_version():
    result = vlmd("--version")
    assert result.returncode == 0 and result.stdout.startswith("vlmd ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--bogus-flag"], "vlmd serve: error: unrecognized arguments: --bogus-flag"),
        (["serve", "--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
        (["serve", "/nonexistent/model"], "MODEL_DIR '/nonexistent/model' does not exist"),
        (["serve", "/etc/hostname"], "is not a directory"),
        (["serve", "/etc"], "has no config.json: not a Hugging Face checkpoint directory"),
        (["serve", "--max-num-seqs", "lots"], "argument --max-num-seqs: expected an integer, got 'lots'"),
        (["serve", "--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
        (["serve", "--port", "99999"], "--port must be at most 65535, got 99999"),
        (["serve", "--host", "nosuchhost.invalid"], "--host 'nosuchhost.invalid' does not resolve"),
        (["serve", "/etc", "--model", "/tmp"], "MODEL_DIR '/etc' and --model '/tmp' differ"),
        (["serve", "--model", "/etc"], "has no config.json: not a Hugging Face checkpoint directory"),
        (["serve", "--limit-mm-per-prompt", "image=x"], "expected MODALITY=N"),
        (["serve", "--mm-processor-kwargs", "[1]"], "--mm-processor-kwargs must be a JSON object"),
        (["serve", "--chat-template", "no-such-file"], "'no-such-file' is neither a file nor a Jinja template"),
        (["serve", "--chat-template", "{% if %}"], "the chat template does not parse"),
        (["serve", "--trust-remote-code"], "--trust-remote-code is not supported"),
    ],
)
def test_bad_invocations_fail_fast_with_one_clear_line(args, message):
    result = vlmd(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing was loaded: the start-up's first log line ("loading") never came (a bound on the
    # wall time instead failed on a loaded 2-core host: 10.7 s for an argument error).
    assert "loading" not in result.stderr and "weights read" not in result.stderr
    if "unrecognized" in message:
        assert result.stderr.startswith("usage: vlmd serve")  # serve's usage, not the top level's


def test_a_port_in_use_is_found_before_the_model_loads(tiny_llava_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = vlmd("serve", str(tiny_llava_dir), "--port", str(port))
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "choose another --port" in result.stderr
    # Found before the model loads: no weights were read (a wall-time bound is a loaded host's to miss).
    assert "Traceback" not in result.stderr and "weights read" not in result.stderr


def test_chat_template_flag_replaces_the_checkpoints_template(tiny_llava_dir, tmp_path):
    """The same request under a template that adds a fixed preamble costs exactly those tokens more."""
    template = tmp_path / "template.jinja"
    template.write_text(
        "SYSTEM PREAMBLE OF FIXED TEXT. {% for message in messages %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endfor %} ASSISTANT:"
    )
    body = {"messages": image_message("Describe it.", random_image(3)), "max_tokens": 2}
    custom = Server(tiny_llava_dir, "--chat-template", str(template), "--no-warmup", log_dir=tmp_path)
    try:
        status, response = custom.chat(body)
        assert status == 200, response
        custom_prompt = response["usage"]["prompt_tokens"]
        inline = template.read_text().replace("SYSTEM PREAMBLE OF FIXED TEXT. ", "")
    finally:
        custom.stop()
    plain = Server(tiny_llava_dir, "--chat-template", inline, "--no-warmup", log_dir=tmp_path)
    try:
        status, response = plain.chat(body)
        assert status == 200, response
        plain_prompt = response["usage"]["prompt_tokens"]
    finally:
        plain.stop()
    assert custom_prompt > plain_prompt >= 576  # the image's placeholders are in both


def test_operator_lines_start_serving_and_shutdown(tiny_llava_dir, tmp_path):
    server = Server(tiny_llava_dir, "--no-warmup", log_dir=tmp_path)
    server.stop()
    lines = server.log_path.read_text().splitlines()
    events = [line for line in lines if '"event"' in line]
    assert all(line.startswith("{") for line in lines if line.strip()), lines  # no progress bar glued to a record
    assert any('"weights read"' in line for line in events)
    assert any('"serving"' in line for line in events)
    assert any('"ready"' in line for line in events)
    assert any('"loading"' in line for line in events[:3]), events[:3]  # before the weights are read
    assert any('"shut down"' in line for line in events)


def test_text_log_format_gives_readable_lines_and_a_ready_line(tiny_llava_dir, tmp_path):
    """--log-format text on a pipe (auto would pick JSON there): no JSON records, and a line
    saying where the server listens is written once it accepts requests."""
    server = Server(tiny_llava_dir, "--no-warmup", "--log-format", "text", log_dir=tmp_path)
    try:
        status, _ = server.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert status == 200
    finally:
        server.stop()
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    assert not any(line.startswith("{") for line in lines), lines
    ready = [line for line in lines if "] ready " in line]
    assert len(ready) == 1 and f"url=http://127.0.0.1:{server.port}" in ready[0], lines
    assert any(" loading " in line for line in lines[:3]), lines[:3]  # said before the weights are read


def test_log_format_is_checked_by_the_parser():
    result = vlmd("serve", "some/dir", "--log-format", "yaml")
    assert result.returncode == 2 and "--log-format" in result.stderr and "Traceback" not in result.stderr
