"""Cross-attention K/V in the memory plan, the KV budget and ``vlmd cost`` (issue 32 item 2,
first stage: counted, not yet paged).

A family declares the bytes one item adds to its request's cross state
(``BaseProcessingInfo.cross_kv_bytes_per_item``); the declaration must equal what a real
request builds: the bytes of ``RunnerRequestState.cross_state`` after its prefill ran through
the tiny Whisper and the tiny Llama 3.2 Vision. The plan reserves it for --max-num-seqs
requests before the KV cache gets the rest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import Server, image_data_url, random_image
from vlmd.engine.memory_plan import GIB, MemoryPlan, cross_kv_bytes_per_request, items_per_request, kv_budget_bytes


def _tensor_bytes(state) -> int:
    """Every tensor reachable from a cross state (lists, tuples, dataclass fields)."""
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(part) for part in state)
    if hasattr(state, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(state, name)) for name in state.__dataclass_fields__)
    return 0


def _prefill_cross_state(model_dir: Path, modality: str, count: int):
    """Run one request with ``count`` of the family's worst-case items through its prefill on
    the real scheduler and runner; return its info and the bytes its cross state holds."""
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.engine.builder import load_model
    from vlmd.engine.core import EngineCore
    from vlmd.plugins.manager import build_registry
    from vlmd.processing.base import ProcessingContext
    from vlmd.runner.model_runner import ModelRunner
    from vlmd.sched.scheduler import Scheduler, SchedulerConfig
    from vlmd.types import EngineRequest, SamplingParams

    hf_config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(hf_config.architectures))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ctx = ProcessingContext(model_dir=str(model_dir), model_id="tiny", hf_config=hf_config, tokenizer=tokenizer,
                            mm_processor_kwargs={}, media_io_kwargs={})
    info = family.load("processing_info")(ctx)
    processor = family.load("processor")(info)
    dummy = family.load("dummy_inputs")(info)
    marker = info.marker_token_id(modality)
    filler = (tokenizer.encode(" the", add_special_tokens=False) or [0])[0]
    output = processor.apply([marker] * count + [filler], {modality: [dummy.dummy_item(modality)] * count})
    model = load_model(str(model_dir), torch.float32, None, hf_config, torch.device("cpu"))
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, block_size=16,
                             num_kv_blocks=8, max_num_encoder_input_tokens=4096, encoder_cache_size=4096,
                             disable_chunked_mm_input=False, enable_prefix_caching=False)
    runner = ModelRunner(model, config.num_kv_blocks, config.block_size, torch.float32, device=torch.device("cpu"))
    core = EngineCore(Scheduler(config), runner)
    core.add_request(EngineRequest("r", list(output.prompt_token_ids), SamplingParams(max_tokens=3, ignore_eos=True),
                                   list(output.items), family_state=output.family_state))
    core.step()  # the prefill: the cross state is built and kept while the request runs
    return info, _tensor_bytes(runner.requests["r"].cross_state)


def test_whisper_declares_the_cross_state_a_request_builds(tiny_whisper_dir):
    info, measured = _prefill_cross_state(tiny_whisper_dir, "audio", 1)
    assert measured > 0
    assert info.cross_kv_bytes_per_item("audio", 4) == measured
    counts = items_per_request(info.supported_mm_limits(), {}, 64)
    assert counts == {"audio": 1}
    assert cross_kv_bytes_per_request(info, counts, 4) == measured


def test_mllama_declares_the_cross_state_of_two_images(tiny_mllama_dir):
    info, measured = _prefill_cross_state(tiny_mllama_dir, "image", 2)
    assert measured > 0
    assert 2 * info.cross_kv_bytes_per_item("image", 4) == measured
    # No limit of its own: the flag bounds it, else the prompt's length.
    counts = items_per_request(info.supported_mm_limits(), {"image": 2}, 64)
    assert cross_kv_bytes_per_request(info, counts, 4) == measured
    assert items_per_request(info.supported_mm_limits(), {}, 64) == {"image": 63}


def test_the_budget_pays_for_the_running_requests_cross_kv():
    assert kv_budget_bytes(100 * GIB, 0.5, 10 * GIB, 5 * GIB, 1 * GIB, 4 * GIB) == 30 * GIB
    with pytest.raises(ValueError, match="--max-num-seqs or --limit-mm-per-prompt"):
        kv_budget_bytes(10 * GIB, 0.5, 1 * GIB, 1 * GIB, 0, 3 * GIB)
    plan = MemoryPlan("cpu", "kv-cache-gb", 0, 0.0, 1, 100, 10, 0, 5, 8192, 16, 1000, 2048,
                      cross_kv_bytes_per_request=7, max_num_seqs=3)
    fields = plan.fields()
    assert fields["cross_kv_bytes"] == 21
    assert fields["planned_bytes"] == 100 + 10 + 5 + 21 + 1000 * 8192


def test_cost_shows_cross_kv(tiny_whisper_dir, tiny_mllama_dir):
    from vlmd.cost import CostOptions, audio_clip, compute_cost, format_table, parse_image

    whisper = compute_cost(str(tiny_whisper_dir), [audio_clip(10)], CostOptions(max_num_seqs=3))
    per_window = whisper["cross_kv"]["max_request_bytes"]
    assert whisper["cross_kv"]["request_bytes"] == per_window > 0
    assert whisper["cross_kv"]["bytes"] == 3 * per_window
    assert "for --max-num-seqs 3" in format_table(whisper)

    options = CostOptions(max_num_seqs=4, limit_mm_per_prompt={"image": 2}, memory_gb=1.0, dtype="bfloat16")
    mllama = compute_cost(str(tiny_mllama_dir), [parse_image("100x60")], options)
    cross = mllama["cross_kv"]
    assert cross["items_per_request"] == {"image": 2}
    assert cross["max_request_bytes"] == 2 * cross["request_bytes"] > 0
    assert cross["bytes"] == 4 * cross["max_request_bytes"] == mllama["cache"]["cross_kv_bytes"]
    json.dumps(mllama)  # the --json report


def test_the_start_up_plan_logs_the_reservation(whisper_server):
    """The session's tiny Whisper server (default --max-num-seqs): its "memory plan" line
    carries the reservation, a window's cross K/V in float32 for every running request."""
    line = next(line for line in whisper_server.log_path.read_text().splitlines() if "memory plan" in line)
    # JSON in a log file (--log-format auto), key=value on a terminal.
    fields = json.loads(line) if line.lstrip().startswith("{") else dict(re.findall(r"(\w+)=(\S+)", line))
    per_request = int(fields["cross_kv_bytes_per_request"])
    assert per_request == 2 * 2 * 64 * 1500 * 4  # decoder layers x (K, V) x d_model x frames x float32
    assert int(fields["cross_kv_bytes"]) == per_request * int(fields["max_num_seqs"]) == per_request * 256
    assert int(fields["planned_bytes"]) >= int(fields["kv_bytes"]) + int(fields["cross_kv_bytes"])
    # And /metrics says the same, as a part of the plan.
    metric = next(line for line in whisper_server.request("GET", "/metrics")[1].decode().splitlines()
                  if line.startswith("vlmd_memory_plan_bytes{") and 'part="cross_kv"' in line)
    assert float(metric.split()[-1]) == int(fields["cross_kv_bytes"])


def test_a_text_only_mllama_server_starts_and_serves_text(tiny_mllama_dir, tmp_path_factory):
    """--limit-mm-per-prompt image=0: text requests skip cross-attention, so the server starts
    (it refused to), holds no cross K/V, serves text and refuses an image with a 4xx."""
    server = Server(tiny_mllama_dir, "--limit-mm-per-prompt", "image=0", "--max-model-len", "256",
                    "--max-num-seqs", "4", log_dir=tmp_path_factory.mktemp("mllama-text-logs"))
    try:
        status, body = server.chat({"model": server.model, "max_tokens": 4, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Write a poem."}]})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
        image = {"type": "image_url", "image_url": {"url": image_data_url(random_image(1, 50, 40))}}
        status, body = server.chat({"model": server.model, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}]})
        assert 400 <= status < 500, body
        line = next(line for line in server.log_path.read_text().splitlines() if "memory plan" in line)
        assert '"cross_kv_bytes_per_request": 0' in line or "cross_kv_bytes_per_request=0" in line
    finally:
        server.stop()
