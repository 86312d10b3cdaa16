"""contrib/bench/scaling.py's server-free parts: the grids and arguments, the widened checkpoint
copy, the inputs of a point, the figures of a run, and the plots drawn from saved lines. No
server starts here; the sweeps themselves are run by hand (README, "Benchmarks")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "contrib" / "bench"))
import scaling  # noqa: E402
import side_by_side  # noqa: E402
from scaling import Point, make_text, parse_args, parse_counts, parse_sizes, summarise, with_flag  # noqa: E402
from scaling_checkpoint import covering_pixels, widened_copy  # noqa: E402
from scaling_plot import read_lines  # noqa: E402


def test_counts_and_sizes_are_read():
    assert parse_counts("1,2,4,8,16,32") == [1, 2, 4, 8, 16, 32]
    assert parse_counts("1k, 4K,16k") == [1024, 4096, 16384]
    assert parse_sizes("224,1344x756, 1920X1080") == [(224, 224), (1344, 756), (1920, 1080)]


@pytest.mark.parametrize("text", ["", "0", "-1", "a", "1.5k", "k", "2,2", "1k,1024"])
def test_bad_counts_are_refused(text):
    with pytest.raises(ValueError):
        parse_counts(text)


@pytest.mark.parametrize("text", ["", "224x", "x224", "0x10", "1x2x3", "a", "224,224x224"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_sizes(text)


def test_defaults_are_the_issues_grid():
    args = parse_args([])
    assert args.sweeps == ["concurrency", "image", "context"]
    assert args.concurrency == [1, 2, 4, 8, 16, 32] and args.context == [1024, 4096, 16384]
    assert args.image_sizes[0] == (224, 224) and args.image_sizes[-1] == (1920, 1080)
    assert (args.concurrency_family, args.image_family, args.context_family) == ("llava", "qwen2_vl", "qwen2_vl")


def test_grids_and_checkpoints_come_from_flags():
    args = parse_args(["--sweeps", "image,context", "--image-sizes", "224,896", "--context", "1k,4k",
                       "--model-dir", "qwen2_vl=/models/q", "--context-requests", "2"])
    assert args.sweeps == ["image", "context"] and args.image_sizes == [(224, 224), (896, 896)]
    assert args.context == [1024, 4096] and args.model_dir == {"qwen2_vl": "/models/q"} and args.context_requests == 2


@pytest.mark.parametrize("argv", [
    ["--sweeps", "latency"], ["--sweeps", ","], ["--concurrency", "0"], ["--image-sizes", "1x"],
    ["--requests", "0"], ["--output-tokens", "0"], ["--point-timeout", "0"],
    ["--plot-from", "x.jsonl"], ["--model-dir", "/no/family"],
    ["--concurrency", "1,500"],  # its 1000 inputs would reach the next point's seeds
])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_vllm_max_model_len_is_replaced_in_side_by_sides_command(tmp_path):
    command, _ = side_by_side.vllm_command(tmp_path, "/model", 8000, "float32", tmp_path)
    widened = with_flag(command, "--max-model-len", "17000")
    assert widened[widened.index("--max-model-len") + 1] == "17000" and len(widened) == len(command)
    assert command[command.index("--max-model-len") + 1] == "2048"  # the original is left alone
    with pytest.raises(ValueError):
        with_flag(command, "--no-such-flag", "1")


def test_covering_pixels_keeps_the_largest_image_unshrunk():
    assert covering_pixels([(224, 224), (1920, 1080)]) == 1932 * 1092
    settings = pytest.importorskip("vlmd_qwen2_vl.settings", reason="the Qwen2-VL plugin (plugins/vlmd_qwen2_vl) is not installed")
    limit = covering_pixels([(1920, 1080)])
    assert settings.smart_resize(1080, 1920, 28, 3136, limit) == (1092, 1932)
    assert settings.smart_resize(1080, 1920, 28, 3136, limit - 1) != (1092, 1932)  # the least such limit


def fake_checkpoint(root: Path) -> Path:
    source = root / "qwen"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights")
    (source / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    image = {"max_pixels": 100352, "min_pixels": 3136, "size": {"longest_edge": 100352, "shortest_edge": 3136}}
    (source / "preprocessor_config.json").write_text(json.dumps(image))
    (source / "processor_config.json").write_text(json.dumps({"image_processor": image, "processor_class": "P"}))
    (source / "video_preprocessor_config.json").write_text(json.dumps(image))
    return source


def test_widened_copy_declares_the_grid_and_shares_the_weights(tmp_path):
    source = fake_checkpoint(tmp_path)
    target = Path(widened_copy(str(source), 16640, 2_109_744))
    assert target.name == "qwen-ctx16640-px2109744"
    assert json.loads((target / "config.json").read_text())["text_config"]["max_position_embeddings"] == 16640
    for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        whole = json.loads((target / name).read_text())
        image = whole[section] if section else whole
        assert image["max_pixels"] == image["size"]["longest_edge"] == 2_109_744 and image["min_pixels"] == 3136
    assert json.loads((target / "video_preprocessor_config.json").read_text())["max_pixels"] == 100352
    assert os.path.samefile(target / "model.safetensors", source / "model.safetensors")
    assert json.loads((source / "config.json").read_text())["text_config"]["max_position_embeddings"] == 8192
    assert widened_copy(str(source), 16640, 2_109_744) == str(target)  # made once


def test_widened_copy_refuses_a_config_without_positions(tmp_path):
    source = fake_checkpoint(tmp_path)
    (source / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        widened_copy(str(source), 16640, None)


class CharTokenizer:
    """A token per character, and a 10-token chat template around the message."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": [0] * 10 + self.encode(messages[0]["content"])}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_context_texts_fill_the_prompt_and_differ_from_the_first_token():
    first, second = make_text(CharTokenizer(), 1024, seed=7), make_text(CharTokenizer(), 1024, seed=8)
    assert len(first) == len(second) == 1024 - 10
    assert first.startswith("Note 7:") and second.startswith("Note 8:")
    with pytest.raises(ValueError):
        make_text(CharTokenizer(), 12, seed=7)


def test_a_points_inputs_are_fresh_and_enough_for_every_client():
    args = parse_args(["--requests", "4", "--image-requests", "2", "--seed", "5"])
    small, large = Point("concurrency", 2, 0, args), Point("concurrency", 8, 1, args)
    assert len(small.inputs) == 4 and len(large.inputs) == 16
    assert len(set(small.inputs + large.inputs + [small.probe, large.probe])) == 4 + 16 + 2
    image = Point("image", (448, 224), 0, args)
    assert (image.x, image.x_label, image.concurrency, len(image.inputs)) == (448 * 224, "448x224", 1, 2)
    assert not set(image.inputs) & set(small.inputs)  # another sweep, other seeds


def test_a_context_point_counts_its_prompt_with_the_tokenizer():
    args = parse_args(["--context-requests", "2", "--seed", "5"])
    point = Point("context", 2048, 1, args, CharTokenizer())
    assert (point.x, point.x_label, point.prompt_tokens, len(point.inputs)) == (2048, "2k", 2048, 2)
    assert point.inputs[0] != point.inputs[1]


def test_a_failed_point_is_a_line_with_its_error_and_the_server_stays_stopped():
    import signal
    import socket
    import subprocess

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = parse_args(["--image-requests", "1", "--point-timeout", "5"])
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        line = scaling.measure_on("vlmd", server, port, Point("image", (224, 224), 0, args), "qwen2_vl", "/m", args)
        assert line["server"] == "vlmd" and line["x_label"] == "224x224" and "ttft_p50_s" not in line
        assert "error" in line and len(line["loadavg"]) == 3
        _, status = os.waitpid(server.pid, os.WUNTRACED)  # returns once it is stopped (or gone)
        assert os.WIFSTOPPED(status)  # stopped again, as the other servers are while one runs
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_figures_of_a_point():
    figures = summarise([(0.5, [0.1, 0.2], 1.0), (0.7, [0.3], 1.2), (0.6, [], 0.6)], elapsed=4.0)
    assert figures == {"requests": 3, "req_per_s": 0.75, "ttft_p50_s": 0.6, "ttft_p90_s": 0.6,
                       "itl_p50_s": 0.2, "wall_s": 4.0}


def synthetic_lines() -> list[dict]:
    lines = []
    for server, factor in (("vlmd", 1.0), ("vllm", 1.3)):
        for c in (1, 2, 4):
            lines.append({"sweep": "concurrency", "server": server, "x": c, "x_label": str(c), "req_per_s": c * factor,
                          "ttft_p50_s": 0.1 * c, "itl_p50_s": 0.02, "loadavg": [1.5, 1.0, 1.0], "model": "/m/llava"})
        for w, h in ((224, 224), (1920, 1080)):
            lines.append({"sweep": "image", "server": server, "x": w * h, "x_label": f"{w}x{h}",
                          "prompt_tokens": w * h // 784, "ttft_p50_s": w * h / 1e6 * factor, "itl_p50_s": 0.02})
        for tokens in (1024, 4096):
            lines.append({"sweep": "context", "server": server, "x": tokens, "x_label": f"{tokens // 1024}k",
                          "ttft_p50_s": tokens / 1000 * factor, "itl_p50_s": None})
    lines.append({"sweep": "context", "server": "vllm", "x": 16384, "error": "RuntimeError: HTTP 400"})
    return lines


def test_plots_are_redrawn_from_saved_lines(tmp_path):
    image = pytest.importorskip("matplotlib.image", reason="matplotlib is in .[bench], not in CI's .[test]")
    saved = tmp_path / "run.jsonl"
    saved.write_text("\n".join(json.dumps(line) for line in synthetic_lines()) + "\n")
    scaling.main(["--plot-from", str(saved), "--plot-dir", str(tmp_path / "plots")])
    pngs = sorted((tmp_path / "plots").iterdir())
    assert [p.name for p in pngs] == ["scaling_concurrency.png", "scaling_context.png", "scaling_image.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = image.imread(png).shape
        assert width > 400 and height > 200


def test_a_foreign_line_is_not_plotted(tmp_path):
    saved = tmp_path / "run.jsonl"
    saved.write_text(json.dumps({"model": "x", "servers": {}}) + "\n")
    with pytest.raises(ValueError, match="not a scaling point"):
        read_lines(saved)
