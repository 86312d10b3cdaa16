"""The scheduler at its edges, torch-free (vlmd/sched/scheduler.py): an item that starts
exactly where a chunk starts or ends, items that fill the encoder budget exactly, a request
that shared a failed step without sharing its blocks, a decode behind a prefill that waits. Found by mutating the scheduler one
operator at a time against its tests: each case fails under a mutant they let through.
"""

from __future__ import annotations

import pytest

from sched_support import FakeRunner, image, make_request, make_scheduler
from vlmd.types import MultiModalItem


def test_a_chunk_at_an_items_start_reaches_its_end_past_the_long_prefill_bound():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_step_tokens=4, disable_chunked_mm_input=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("img", 0, 12),), max_tokens=2))
    sched.add_request(make_request("b", 20, max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 12}  # the image whole, though the bound is 4
    runner.run()


def test_an_item_that_starts_where_a_chunk_ends_waits_for_the_next_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("img", 8, 8),), max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 8} and not out.scheduled_encoder_inputs
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"a": [0]}
    runner.run()


def _two_at_the_start(encoder_tokens: int) -> tuple[MultiModalItem, MultiModalItem]:
    """Two items without placeholders at offset 0 (an encoder-decoder's inputs)."""
    return (MultiModalItem("image", "x", 0, 0, encoder_tokens=encoder_tokens),
            MultiModalItem("image", "y", 0, 0, encoder_tokens=encoder_tokens))


def test_items_without_placeholders_at_one_offset_fit_the_encoder_budget_together():
    sched = make_scheduler(max_num_encoder_input_tokens=16, encoder_cache_size=16)
    sched.add_request(make_request("fits", 4, items=_two_at_the_start(8)))  # 16 together: the budget exactly
    with pytest.raises(ValueError, match="need 18 encoder tokens at once"):
        sched.add_request(make_request("over", 4, items=_two_at_the_start(9)))
    assert list(sched.requests) == ["fits"]


def test_a_request_that_shared_a_failed_step_but_none_of_its_blocks_goes_on():
    sched = make_scheduler(num_kv_blocks=64, enable_prefix_caching=True)
    sched.add_request(make_request("culprit", 16))
    other = make_request("other", 16)
    other.prompt_token_ids = [500 + i for i in range(16)]
    sched.add_request(other)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"culprit", "other"}
    assert sched.fail_requests({"culprit": "boom"}, out.num_scheduled_tokens) == []
    assert sched.requests["other"].num_computed_tokens == 16 and sched.running == [sched.requests["other"]]


def test_a_step_encodes_no_more_than_its_encoder_budget_across_items():
    sched = make_scheduler(max_num_encoder_input_tokens=16, encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 30, items=(image("x", 2, 10), image("y", 14, 10)), max_tokens=2))
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"a": [0]} and out.num_scheduled_tokens == {"a": 14}
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"a": [1]}
    runner.run()


def test_a_failed_later_chunk_unregisters_its_own_blocks_only():
    sched = make_scheduler(num_kv_blocks=64, enable_prefix_caching=True, max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("culprit", 40))
    runner.step()  # tokens 0..15: blocks 0-3, written
    out = sched.schedule()  # tokens 16..31: blocks 4-7, registered at allocation, then the step raises
    assert out.num_scheduled_tokens == {"culprit": 16}
    hashes = list(sched.requests["culprit"].block_hashes)
    sched.fail_requests({"culprit": "boom"}, out.num_scheduled_tokens)
    found = [sched.kv.pool.lookup((0, block_hash)) is not None for block_hash in hashes[:8]]
    assert found == [True] * 4 + [False] * 4


def test_a_decode_behind_a_prefill_that_waits_for_the_encoder_still_runs():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=64)
    runner = FakeRunner(sched)
    # Two prompts of text, an image, text, an image, text (36 tokens); then a short text prompt.
    sched.add_request(make_request("a", 36, items=(image("a1", 4, 12), image("a2", 20, 12)), max_tokens=2))
    sched.add_request(make_request("b", 36, items=(image("b1", 4, 12), image("b2", 20, 12)), max_tokens=2))
    sched.add_request(make_request("d", 4, max_tokens=8))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 20, "b": 4, "d": 4}
    out, _ = runner.step()  # a's second image takes the encoder budget: b waits, d decodes
    assert out.num_scheduled_tokens == {"a": 16, "d": 1}
    runner.run()
