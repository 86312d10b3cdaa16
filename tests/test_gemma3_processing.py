"""Gemma 3's processing against transformers' processor, without a server: crop counts and
``item_tokens`` for many sizes, the replacement ids, the pixels; ``vlmd cost``; and the
scheduler keeping an item whole when a prefix hit starts a chunk inside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_image
from gemma3_oracle import gemma3_inputs, load_hf_gemma3
from sched_support import image, make_request, make_scheduler
from vlmd.cost import CostOptions, compute_cost, parse_image
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd.sched.scheduler import _Budget

SIZES = [(64, 64), (80, 70), (200, 60), (60, 200), (100, 80), (130, 31), (31, 130), (500, 90), (90, 300),
         (33, 64), (257, 64), (1000, 40)]


@pytest.fixture(scope="module")
def info(tiny_gemma3_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vlmd_gemma3.processing import Gemma3ProcessingInfo

    ctx = ProcessingContext(model_dir=str(tiny_gemma3_dir), model_id="tiny", hf_config=AutoConfig.from_pretrained(
        tiny_gemma3_dir), tokenizer=AutoTokenizer.from_pretrained(tiny_gemma3_dir),
        mm_processor_kwargs={"do_pan_and_scan": True})  # a server that allows crops
    return Gemma3ProcessingInfo(ctx)


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_item_tokens_and_replacement_equal_transformers(tiny_gemma3_dir, info, pan_and_scan):
    _, processor = load_hf_gemma3(str(tiny_gemma3_dir))
    kwargs = {"do_pan_and_scan": pan_and_scan}
    seen_crops = set()
    for width, height in SIZES:
        picture = random_image(width + height, width, height)
        crops = int(processor.image_processor(images=[picture], do_pan_and_scan=pan_and_scan)["num_crops"][0])
        seen_crops.add(crops)
        tokens = info.item_tokens("image", ItemSize(width, height), kwargs)
        text = processor.replace_image_token({"num_crops": [crops]}, 0)
        expected = processor.tokenizer.encode(text, add_special_tokens=False)
        ids, first, last, spans = info.replacement(crops)
        assert list(ids) == expected, (width, height)
        assert tokens.replacement == len(expected)
        assert tokens.placeholders == last - first == spans[-1][1]
        assert len(spans) == 1 + crops and all(b - a == 16 for a, b in spans)
    assert seen_crops == ({0} if not pan_and_scan else {0, 2, 3, 4}), seen_crops


@pytest.mark.parametrize("size", [(80, 70), (200, 60), (60, 150), (1000, 40)])
def test_pixels_equal_transformers(tiny_gemma3_dir, info, size):
    from vlmd_gemma3.processing import Gemma3Processor

    picture = random_image(size[0], *size)
    processed = Gemma3Processor(info).process_item("image", picture, {"do_pan_and_scan": True})
    pixels = torch.from_numpy(processed.encoder_inputs["pixels"]).float() / 255.0
    ours = (pixels - 0.5) / 0.5
    _, processor = load_hf_gemma3(str(tiny_gemma3_dir))
    theirs = processor.image_processor(images=[picture], do_pan_and_scan=True, return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_cost_equals_the_processor(tiny_gemma3_dir):
    """``vlmd cost``'s prompt tokens are the length of transformers' prompt for the same items."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi."}]}]
    pictures = [random_image(1, 200, 60), random_image(2, 64, 64)]
    for pan_and_scan in (False, True):
        report = compute_cost(str(tiny_gemma3_dir), [parse_image("200x60"), parse_image("64x64")],
                              CostOptions(prompt="Hi.", mm_processor_kwargs={"do_pan_and_scan": pan_and_scan}))
        inputs = gemma3_inputs(tiny_gemma3_dir, messages, pictures, pan_and_scan)
        assert report["prompt_tokens"] == inputs["input_ids"].shape[1]
        assert np.array_equal(report["items"][1]["placeholder_tokens"], 16)


def test_a_chunk_starting_inside_a_whole_item_reaches_its_end_or_waits():
    """A prefix hit can end inside an item (its first blocks were cached by another request
    with the same image): with items kept whole, the next chunk takes the item's rest in
    one step, or nothing while the budget is short."""
    scheduler = make_scheduler(disable_chunked_mm_input=True, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", 40, items=(image("img", 2, 20),)))
    request = scheduler.requests["a"]
    request.num_computed_tokens = 12  # as after a 12-token prefix hit
    assert scheduler._plan_chunk(request, _Budget(8, 64))[0] == 0
    assert scheduler._plan_chunk(request, _Budget(10, 64))[0] == 10
    assert scheduler._plan_chunk(request, _Budget(32, 64))[0] == 28
