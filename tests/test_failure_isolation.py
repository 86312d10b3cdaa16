"""A step that raises fails only the request that made it raise (engine level, in process).

The fault-injection hook (vlmd.testing.faults, installed here on the models the engine
loads, on only when VLMD_FAULT_INJECTION is set) makes the image encoder raise for a solid-colour image and the decoder forward raise, after
writing K/V, for a batch holding the ``<pad>`` token. Both are mixed into a batch of good
requests with chunked prefill (token budget 256 < one image's 576 placeholders) and
preemption (64 KV blocks for three ~600-token image requests) active. The good requests
must produce exactly the tokens they produce alone in a clean engine, the poisoned ones end
with an error, and the engine is left drained with every block and encoder slot free.
The HTTP version, against transformers, is in test_fault_isolation_server.py.
"""

from __future__ import annotations

import json

import pytest

from conftest import random_image
from vlmd.config import ServeConfig
from vlmd.types import EngineRequest, FinishReason, SamplingParams
from vlmd.testing.faults import ENV

POISON_PIXEL = 13
FAULTS = json.dumps({"encoder_pixel_value": POISON_PIXEL, "forward_token_id": 4095})  # 4095 = <pad>


def build(model_dir, monkeypatch, faults: bool):
    from vlmd.engine import builder
    from vlmd.testing.faults import loading_with_faults

    monkeypatch.setattr(builder, "load_model", loading_with_faults(builder.load_model))
    if faults:
        monkeypatch.setenv(ENV, FAULTS)
    else:
        monkeypatch.delenv(ENV, raising=False)
    config = ServeConfig(model=str(model_dir), max_model_len=1024, max_num_batched_tokens=256, num_kv_blocks=64,
                         mm_processor_cache_gb=0)
    return builder.build_engine(config)


def image_request(built, request_id: str, image, text: str, max_tokens: int = 12) -> EngineRequest:
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": text}]}]
    preprocessor = built.preprocessor
    preprocessor._load = lambda ref, *stages_and_length: image if isinstance(image, Image.Image) else None
    processed = preprocessor.process_chat(messages)
    return EngineRequest(request_id, processed.prompt_token_ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                         processed.items, eos_token_ids=built.eos_token_ids)


def text_request(built, request_id: str, text: str, max_tokens: int = 12) -> EngineRequest:
    processed = built.preprocessor.process_chat([{"role": "user", "content": text}])
    return EngineRequest(request_id, processed.prompt_token_ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                         eos_token_ids=built.eos_token_ids)


def run(core, requests: list[EngineRequest]) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    results = {r.request_id: [[], None, None] for r in requests}
    for request in requests:
        core.add_request(request)
    steps = 0
    while core.has_work():
        deltas, _ = core.step()
        for delta in deltas:
            entry = results[delta.request_id]
            entry[0].extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                entry[1], entry[2] = delta.finish_reason, delta.error
        steps += 1
        assert steps < 5000, "the engine did not drain"
    return {rid: tuple(value) for rid, value in results.items()}


def assert_drained(core) -> None:
    scheduler = core.scheduler
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
    assert scheduler.kv.num_free_blocks == scheduler.kv.pool.num_blocks
    assert scheduler.encoder_cache.num_freeable_slots == scheduler.encoder_cache.cache_size


@pytest.fixture(scope="module")
def requests_spec():
    poison = random_image(0, 80, 60).point(lambda _: POISON_PIXEL)
    return [
        ("good-a", "image", random_image(21, 120, 90), "Describe the picture."),
        ("bad-encoder", "image", poison, "Describe the picture."),
        ("good-b", "image", random_image(22, 90, 120), "What is in it?"),
        ("good-text", "text", None, "Tell me about zebras and quartz."),
        ("bad-forward", "text", None, "hello <pad> there"),
        ("good-c", "image", random_image(23, 64, 64), "Colours?"),
    ]


def make(built, spec):
    request_id, kind, image, text = spec
    return image_request(built, request_id, image, text) if kind == "image" else text_request(built, request_id, text)


def test_poisoned_requests_fail_alone(tiny_llava_dir, monkeypatch, requests_spec):
    clean = build(tiny_llava_dir, monkeypatch, faults=False)
    expected = {}
    for spec in requests_spec:
        if spec[0].startswith("good"):
            (result,) = run(clean.core, [make(clean, spec)]).values()
            expected[spec[0]] = result[0]

    built = build(tiny_llava_dir, monkeypatch, faults=True)
    core = built.core
    results = run(core, [make(built, spec) for spec in requests_spec])
    for request_id, (tokens, reason, error) in results.items():
        if request_id.startswith("bad"):
            assert reason is FinishReason.ERROR and "InjectedFault" in error, (request_id, reason, error)
        else:
            assert reason in (FinishReason.STOP, FinishReason.LENGTH), (request_id, reason, error)
            assert tokens == expected[request_id], request_id
    stats = core.stats()
    assert stats.num_failed_steps >= 2 and stats.num_requests_failed == 2
    assert stats.num_preemptions > 0, "the test must exercise preemption"
    assert_drained(core)

    # The engine keeps serving, and the poisoned image is not taken for a resident output.
    again = run(core, [make(built, requests_spec[0]), make(built, requests_spec[1])])
    assert again["good-a"][0] == expected["good-a"]
    assert again["bad-encoder"][1] is FinishReason.ERROR
    assert_drained(core)
