"""contrib/bench/bench_layouts.py's torch-free parts: its arguments, the image seeds that keep
every measurement's images fresh, the /metrics reading, and the ratios of its summary line.
No server starts here; the bench itself is run by hand (docs/deploy.md, "Which layout")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "contrib" / "bench"))
import bench_layouts  # noqa: E402
from bench_layouts import (  # noqa: E402
    LAYOUT_ORDER, WORKLOADS, build_layout, chat_body, image_seeds, median_figures, parse_args, parse_metrics,
    summarize,
)


def test_defaults_keep_the_run_small():
    args = parse_args([])
    assert (args.images_per_request, args.requests_images, args.requests_1img) == (4, 16, 32)
    assert args.output_tokens == 32 and args.rounds == 2 and args.cores is None and args.only is None


@pytest.mark.parametrize("argv", [
    ["--requests-images", "0"], ["--rounds", "0"], ["--images-per-request", "0"],
    ["--cores", "0"], ["--cores", "1,1"], ["--cores", "0,x"], ["--only", "no_such_workload"],
    ["--requests-1img", "999"],  # its images would overlap the next workload's seeds
])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_arguments_are_read():
    args = parse_args(["--cores", "2,5", "--only", "llava_1img_c8", "--requests-1img", "4", "--rounds", "3"])
    assert args.cores == [2, 5] and args.only == ["llava_1img_c8"] and args.requests_1img == 4 and args.rounds == 3


def test_every_measurement_gets_its_own_images():
    count = 4 * (16 + 2)
    seen: set[int] = set()
    for round_index in range(3):
        for layout in LAYOUT_ORDER:
            for workload in WORKLOADS:
                seeds = image_seeds(7, round_index, layout, workload.name, count)
                assert len(seeds) == count and not seen & set(seeds), (round_index, layout, workload.name)
                seen |= set(seeds)


def test_workloads_compare_against_one_server():
    for workload in WORKLOADS:
        assert workload.layouts[0] == "single" and set(workload.layouts) <= set(LAYOUT_ORDER)
    assert {w.name for w in WORKLOADS if "epd" in w.layouts} == {
        "llava_images_c1", "llava_images_c4", "qwen2_vl_images_c1", "qwen2_vl_images_c4"}
    assert [w.concurrency for w in WORKLOADS if "dp2" in w.layouts] == [8]


def test_chat_body_carries_every_image_and_asks_for_a_fixed_length():
    body = chat_body(["data:a", "data:b", "data:c", "data:d"], 32)
    parts = body["messages"][0]["content"]
    assert [part["image_url"]["url"] for part in parts[:-1]] == ["data:a", "data:b", "data:c", "data:d"]
    assert parts[-1]["type"] == "text"
    assert body["max_tokens"] == 32 and body["ignore_eos"] is True and body["stream"] is True


def test_layouts_pin_their_cores():
    args = parse_args(["--cores", "0,1", "--port", "9000"])
    epd = build_layout("epd", "/m", args)
    (encoder_role, encoder, _, encoder_port), (language_role, language, _, language_port) = epd.processes
    assert (encoder_role, language_role) == ("encoder", "language")
    assert encoder[:3] == ["taskset", "-c", "0"] and language[:3] == ["taskset", "-c", "1"]
    assert "--encoder-only" in encoder and language[language.index("--encoder-urls") + 1] == f"http://127.0.0.1:{encoder_port}"
    assert language[language.index("--encoder-fallback") + 1] == "fail"  # a local encode is an error, not a figure
    assert epd.url == f"http://127.0.0.1:{language_port}" == "http://127.0.0.1:9000"
    single = build_layout("single", "/m", args).processes[0][1]
    assert single[single.index("--torch-threads") + 1] == "2" and single[0] != "taskset"
    dp = build_layout("dp2", "/m", args)
    assert str(bench_layouts.DP_SCRIPT) in dp.processes[0][1] and set(dp.metrics) == {"replica0", "replica1"}
    tp = build_layout("tp2", "/m", args).processes[0][1]
    assert tp[tp.index("--tensor-parallel-size") + 1] == "2"
    with pytest.raises(ValueError):
        build_layout("dp3", "/m", args)


def test_metrics_are_summed_over_labels():
    text = "\n".join([
        "# HELP vlmd_engine_step_seconds One engine step",
        'vlmd_engine_step_seconds_sum{kind="decode"} 1.5',
        'vlmd_engine_step_seconds_sum{kind="prefill"} 2.25',
        'vlmd_engine_step_seconds_count{kind="prefill"} 9.0',
        "vlmd_encoder_forward_seconds_sum 0.5",
        'vlmd_media_fetch_seconds_sum{modality="image"} 0.125',
        'vlmd_media_preprocess_seconds_sum{modality="image"} 0.25',
        "vlmd_encoder_forwards_total 8.0",
    ])
    assert parse_metrics(text) == {"step_s": 3.75, "encoder_s": 0.5, "preprocess_s": 0.375, "encodes": 8.0}
    assert parse_metrics("") == {"step_s": 0.0, "encoder_s": 0.0, "preprocess_s": 0.0, "encodes": 0.0}


def line(workload, layout, req_per_s, ttft, tpot, rounds=()):
    return {"workload": workload, "layout": layout, "req_per_s": req_per_s, "ttft_p50_s": ttft, "tpot_p50_s": tpot,
            "req_per_s_rounds": list(rounds)}


def test_summary_ratios_say_better_above_one():
    lines = [line("w", "single", 2.0, 0.5, 0.02, (1.0, 3.0)), line("w", "dp2", 3.0, 1.0, 0.04, (3.0, 3.0)),
             line("w", "tp2", 1.0, 0.25, 0.01, (0.5, 1.5))]
    summary = summarize(lines)["w"]
    assert summary["dp2_vs_single"] == {"req_per_s": 1.5, "ttft_p50": 0.5, "tpot_p50": 0.5,
                                        "req_per_s_rounds": [3.0, 1.0]}  # round by round
    assert summary["tp2_vs_single"] == {"req_per_s": 0.5, "ttft_p50": 2.0, "tpot_p50": 2.0,
                                        "req_per_s_rounds": [0.5, 0.5]}
    assert summary["best"] == {"req_per_s": "dp2", "ttft_p50": "tp2", "tpot_p50": "tp2"}
    assert "single_vs_single" not in summary


def test_summary_without_a_figure_says_none():
    summary = summarize([line("w", "single", 2.0, 0.5, None), line("w", "epd", 1.0, 0.4, None)])["w"]
    assert summary["epd_vs_single"]["tpot_p50"] is None and summary["best"]["tpot_p50"] is None
    assert summary["best"]["ttft_p50"] == "epd"


def test_rounds_give_medians():
    runs = [{"req_per_s": r, "ttft_p50_s": t, "tpot_p50_s": 0.01, "wall_s": 5.0, "prompt_tokens": 600,
             "startup_s": 9.0, "busy": {}} for r, t in ((1.0, 0.3), (3.0, 0.1), (2.0, 0.2))]
    figures = median_figures(runs)
    assert figures["req_per_s"] == 2.0 and figures["ttft_p50_s"] == 0.2
    assert figures["req_per_s_rounds"] == [1.0, 3.0, 2.0] and figures["ttft_p50_s_rounds"] == [0.3, 0.1, 0.2]
    assert figures["prompt_tokens"] == 600
