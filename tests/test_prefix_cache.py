"""Prefix caching in the torch-free scheduler: hashes with media keys, sharing, eviction."""

from __future__ import annotations

from sched_support import FakeRunner, image, make_request, make_scheduler

from vlmd.sched.block_hash import block_extra_keys, extend_block_hashes
from vlmd.sched.block_pool import BlockPool
from vlmd.types import EngineRequest, SamplingParams


def cached_scheduler(**overrides):
    return make_scheduler(enable_prefix_caching=True, **overrides)


def finish(sched, runner, request_id):
    while request_id in sched.requests:
        runner.step()


def test_second_request_with_the_same_prompt_reuses_full_blocks():
    sched = cached_scheduler(block_size=4, num_kv_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 18, max_tokens=2))
    finish(sched, runner, "a")
    sched.add_request(make_request("b", 18, max_tokens=2))
    out, _ = runner.step()
    (new,) = out.new_requests
    assert new.num_computed_tokens == 16  # four full blocks; the last two tokens are computed
    assert out.num_scheduled_tokens["b"] == 2
    assert sched.requests["b"].num_cached_tokens == 16
    assert sched.kv.prefix_hits == 16 and sched.kv.prefix_queries == 36


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = cached_scheduler(block_size=4, num_kv_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 16, max_tokens=1))
    finish(sched, runner, "a")
    sched.add_request(make_request("b", 16, max_tokens=1))
    out, _ = runner.step()
    assert out.new_requests[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens["b"] == 4


def test_identical_requests_in_one_step_share_blocks():
    sched = cached_scheduler(block_size=4, num_kv_blocks=64, max_num_batched_tokens=256)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    out, _ = runner.step()
    a, b = out.new_requests
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 16
    assert a.block_tables[0][:4] == b.block_tables[0][:4]  # shared by reference
    assert a.block_tables[0][4] != b.block_tables[0][4]
    sched.abort_requests(["a"])
    # b still holds the shared blocks: they are not free until b lets go.
    assert sched.kv.num_free_blocks == 64 - 5  # four shared blocks and its own fifth
    sched.abort_requests(["b"])
    assert sched.kv.num_free_blocks == 64


def test_different_images_of_the_same_size_never_share_a_block():
    # Prompt: 4 text tokens, an 8-token image at offset 4, 4 text tokens.
    sched = cached_scheduler(block_size=4, num_kv_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 16, items=(image("cat", 4, 8),), max_tokens=1))
    finish(sched, runner, "a")
    sched.add_request(make_request("b", 16, items=(image("dog", 4, 8),), max_tokens=1))
    out, _ = runner.step()
    assert out.new_requests[0].num_computed_tokens == 4  # only the text block before the image
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_the_same_image_at_another_offset_has_other_hashes():
    items_a = [image("cat", 4, 8)]
    items_b = [image("cat", 5, 8)]
    tokens = list(range(16))
    hashes_a, hashes_b = [], []
    extend_block_hashes(hashes_a, tokens, items_a, 4)
    extend_block_hashes(hashes_b, tokens, items_b, 4)
    assert hashes_a[0] == hashes_b[0]  # the block before both images
    assert hashes_a[1] != hashes_b[1]
    assert block_extra_keys(items_a, 4, 8) == (("cat", 0),)
    assert block_extra_keys(items_b, 4, 8) == (("cat", 1),)
    assert block_extra_keys(items_a, 12, 16) == ()


def test_same_image_second_question_skips_the_encoder():
    sched = cached_scheduler(block_size=4, num_kv_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 16, items=(image("cat", 4, 8),), max_tokens=1))
    finish(sched, runner, "a")
    second = EngineRequest(
        "b", [100 + i for i in range(14)] + [7, 7, 7], SamplingParams(max_tokens=1), [image("cat", 4, 8)]
    )
    sched.add_request(second)
    out, _ = runner.step()
    assert out.new_requests[0].num_computed_tokens == 12  # text + the whole image
    assert out.scheduled_encoder_inputs == {}


def test_a_hit_that_ends_inside_an_image_needs_its_encoder_output():
    # Image over [4, 12); the hit covers blocks [0, 8): the image's second half must still
    # be computed, so its encoder output is needed.
    sched = cached_scheduler(block_size=4, num_kv_blocks=64, max_num_encoder_input_tokens=8, encoder_cache_size=8)
    runner = FakeRunner(sched)
    prompt = [100 + i for i in range(16)]
    first = EngineRequest("a", prompt[:8] + [1, 2], SamplingParams(max_tokens=1), [image("cat", 4, 8)])
    # "a" only reaches token 10: its blocks [0, 8) are full and cached, the image is cut.
    sched.add_request(first)
    finish(sched, runner, "a")
    sched.encoder_cache.can_allocate(8, 8, 0)  # evict a's unused output: b must encode again
    sched.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1), [image("cat", 4, 8)]))
    out, _ = runner.step()
    assert out.new_requests[0].num_computed_tokens == 8
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_a_hit_inside_an_image_waits_when_the_encoder_cannot_take_it():
    sched = cached_scheduler(
        block_size=4, num_kv_blocks=64, max_num_batched_tokens=10,
        max_num_encoder_input_tokens=8, encoder_cache_size=8,
    )
    runner = FakeRunner(sched)
    prompt = [100 + i for i in range(16)]
    sched.add_request(EngineRequest("a", prompt[:8] + [1, 2], SamplingParams(max_tokens=1), [image("cat", 4, 8)]))
    finish(sched, runner, "a")
    # "hog" fills the encoder cache and still needs its image after this step: [0, 10) of [4, 12).
    sched.add_request(EngineRequest("hog", [5] * 16, SamplingParams(max_tokens=50), [image("big", 4, 8)]))
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"hog": [0]}
    sched.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1), [image("cat", 4, 8)]))
    out, _ = runner.step()
    # b's hit ends at 8, inside its image, and the cache has no room: b computes nothing yet.
    assert "b" not in out.num_scheduled_tokens
    assert sched.requests["b"].num_computed_tokens == 0  # the tentative hit was not kept
    out, _ = runner.step()  # hog has released its image: b goes ahead from its hit
    assert out.new_requests[0].request_id == "b" and out.new_requests[0].num_computed_tokens == 8
    assert out.scheduled_encoder_inputs["b"] == [0]


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.cache(first[0], b"h0")
    pool.cache(first[1], b"h1")
    pool.free(first[::-1])  # tail first, as requests free
    assert pool.lookup(b"h0") == first[0]
    taken = pool.allocate(3)  # two never-used blocks, then the oldest freed: h1's block
    assert first[1] in taken and pool.lookup(b"h1") is None
    assert pool.lookup(b"h0") == first[0]
    pool.touch([first[0]])  # a hit takes it off the free list
    assert pool.num_free_blocks == 0


def test_eviction_under_pressure_keeps_serving():
    sched = cached_scheduler(block_size=4, num_kv_blocks=16, max_model_len=64)
    runner = FakeRunner(sched)
    for index in range(12):
        prompt = [1000 * index + i for i in range(20)]
        sched.add_request(EngineRequest(f"r{index}", prompt, SamplingParams(max_tokens=4)))
    runner.run()
    assert not sched.has_work() and sched.kv.num_free_blocks == 16


def test_prefix_caching_off_finds_nothing():
    sched = make_scheduler(block_size=4, num_kv_blocks=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 18, max_tokens=1))
    finish(sched, runner, "a")
    sched.add_request(make_request("b", 18, max_tokens=1))
    out, _ = runner.step()
    assert out.new_requests[0].num_computed_tokens == 0
