"""A step's new images, every request's, go through the vision tower in one call (issue 48:
c8 new images is one tower call, not eight, where the encoder budget admits them: D110's
default is one item a step), counted by the engine (``num_encoder_calls``,
``vlmd_encoder_calls_total``) beside the items it encoded (``num_encoder_forwards``), and
each request's tokens are what it gets alone."""

from __future__ import annotations

from conftest import random_image
from vlmd.config import ServeConfig
from vlmd.types import EngineRequest, SamplingParams


def _engine(model_dir):
    from vlmd.engine import builder

    # Budgets that admit all four image prompts in one step (tiny LLaVA: 576 placeholders).
    # The encoder's defaults to one item a step (D110: a short request waits for one image's
    # encoder, not a flood's); a server for image throughput raises it, as here, and lifts the
    # bound on a shared step's long prefill tokens (D119: under it a step's chunks reach one
    # request's image, so the four would be encoded in four steps, one call each).
    config = ServeConfig(model=str(model_dir), max_model_len=1024, max_num_batched_tokens=4096,
                         max_num_encoder_input_tokens=4096, long_prefill_step_tokens=0, mm_processor_cache_gb=0,
                         enable_prefix_caching=False)
    return builder.build_engine(config)


def _request(built, request_id: str, image) -> EngineRequest:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "Describe it."}]}]
    built.preprocessor._load = lambda ref, *stages_and_length: image
    processed = built.preprocessor.process_chat(messages)
    return EngineRequest(request_id, processed.prompt_token_ids, SamplingParams(max_tokens=4, temperature=0),
                         processed.items, eos_token_ids=built.eos_token_ids)


def _run(core, requests):
    tokens = {request.request_id: [] for request in requests}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for delta in core.step()[0]:
            tokens[delta.request_id].extend(delta.new_token_ids)
    return tokens


def test_a_steps_images_are_encoded_in_one_call(tiny_llava_dir):
    images = [random_image(40 + index, 96 + 8 * index, 72) for index in range(4)]
    built = _engine(tiny_llava_dir)
    alone = {}
    for index, image in enumerate(images):
        alone.update(_run(built.core, [_request(built, f"r{index}", image)]))
    assert built.core.stats().num_encoder_calls == 4  # one request a step: one call each

    together = _engine(tiny_llava_dir)
    tokens = _run(together.core, [_request(together, f"r{index}", image) for index, image in enumerate(images)])
    stats = together.core.stats()
    assert (stats.num_encoder_forwards, stats.num_encoder_calls) == (4, 1)
    assert tokens == alone
