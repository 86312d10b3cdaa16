"""The cross-attention pool's accounting, without torch (vlmd/sched/cross_kv.py, D93).

A request's cross table is allocated whole when it is first scheduled, held unchanged for its
life, freed when it finishes or is preempted; a request whose table does not fit waits; one
that could never fit is refused at admission. The fake runner (sched_support) checks at every
step that each scheduled request's table is whole, the same on both sides, never shared.
"""

from __future__ import annotations

import pytest

from sched_support import make_request, make_scheduler
from test_scheduler_encoder_decoder import EncoderDecoderRunner, audio
from vlmd.errors import RequestRejected
from vlmd.sched.cross_kv import CrossPool, cross_tokens_of, is_consecutive
from vlmd.types import MultiModalItem


def test_the_pool_hands_out_consecutive_runs_first_fit():
    pool = CrossPool(10)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 3) == [3, 4, 5]
    assert pool.allocate("c", 2) == [6, 7]
    pool.free("b")
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 5
    assert pool.allocate("d", 2) == [3, 4]  # the first run that fits
    assert pool.allocate("e", 2) == [8, 9]  # [5] alone is too short
    assert pool.num_gathered_tables == 0


def test_a_fragmented_pool_still_allocates_and_counts_it():
    pool = CrossPool(6)
    for name in "abcdef":
        pool.allocate(name, 1)
    pool.free("b")
    pool.free("d")
    pool.free("f")
    table = pool.allocate("g", 3)
    assert table == [1, 3, 5] and not is_consecutive(table) and pool.num_gathered_tables == 1
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="asked for 1 cross-attention blocks, 0 free"):
        pool.allocate("h", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("g", 0)
    pool.free("g")
    pool.free("never-held")  # nothing to give back
    assert pool.num_free_blocks == 3 and pool.peak_request_blocks == 3


def test_cross_tokens_are_those_of_the_items_without_placeholders():
    items = [audio("x", 15), MultiModalItem(modality="image", identifier="i", offset=3, length=4)]
    assert cross_tokens_of(items) == 15
    assert cross_tokens_of([]) == 0


def test_a_request_takes_its_whole_table_at_its_first_chunk_and_keeps_it():
    # 15 encoder tokens in blocks of 4: 4 blocks, taken with the first of several chunks.
    sched = make_scheduler(max_num_batched_tokens=4, max_num_encoder_input_tokens=20, encoder_cache_size=20,
                           cross_kv_blocks=8)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 10, items=(audio("x"),), max_tokens=3))
    out, _ = runner.step()
    assert [data.cross_block_ids for data in out.new_requests] == [[0, 1, 2, 3]]
    assert sched.kv.cross_stats() == {"num_blocks": 8, "used_blocks": 4, "peak_request_blocks": 4}
    out, _ = runner.step()
    assert out.new_requests == [] and sched.kv.cross_block_ids("a") == [0, 1, 2, 3]
    runner.run()
    assert sched.kv.cross_stats()["used_blocks"] == 0  # finished: every block back


def test_a_request_waits_while_the_pool_cannot_hold_its_table():
    # Room for two tables of 4: the third request waits, the main pool and budget have room.
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, cross_kv_blocks=8)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=2))
    sched.add_request(make_request("b", 2, items=(audio("y"),), max_tokens=6))
    sched.add_request(make_request("c", 2, items=(audio("z"),), max_tokens=2))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and [r.request_id for r in sched.waiting] == ["c"]
    assert sched.kv.cross.num_free_blocks == 0
    out, _ = runner.step()  # a samples its second token and finishes
    assert "c" not in out.num_scheduled_tokens
    out, _ = runner.step()  # a's table is free: c takes it
    assert [data.request_id for data in out.new_requests] == ["c"]
    assert sorted(out.new_requests[0].cross_block_ids) == [0, 1, 2, 3]
    runner.run()
    assert sched.kv.cross_stats()["used_blocks"] == 0
    assert runner.output_tokens("c") == [7, 7]


def test_a_text_only_request_holds_no_cross_blocks_and_is_not_held_up():
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, cross_kv_blocks=4)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=4))
    sched.add_request(make_request("text", 3, max_tokens=2))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"a", "text"}
    assert sched.kv.cross_block_ids("text") == [] and sched.kv.cross.num_free_blocks == 0
    runner.run()


def test_preemption_gives_the_cross_blocks_back_and_the_resume_takes_them_again():
    # 6 main blocks of 4 tokens: three requests growing to 10 tokens cannot all stay.
    sched = make_scheduler(num_kv_blocks=6, max_num_encoder_input_tokens=45, encoder_cache_size=45,
                           cross_kv_blocks=12)
    runner = EncoderDecoderRunner(sched)
    for name, identifier in (("a", "x"), ("b", "y"), ("c", "x")):
        sched.add_request(make_request(name, 2, items=(audio(identifier),), max_tokens=8))
    seen_preempted = False
    while sched.has_work():
        out, _ = runner.step()
        for request in sched.waiting:
            if request.num_preemptions:
                seen_preempted = True
                assert sched.kv.cross_block_ids(request.request_id) == []  # freed with its main blocks
        held = sum(len(sched.kv.cross_block_ids(r.request_id)) for r in sched.running)
        assert sched.kv.cross_stats()["used_blocks"] == held == 4 * len(sched.running)
    assert seen_preempted and sched.num_preemptions > 0
    assert runner.derivations == 3 + sched.num_preemptions
    for name in "abc":
        assert runner.output_tokens(name) == [7] * 8
    assert sched.kv.cross_stats()["used_blocks"] == 0


def test_an_abort_frees_the_cross_blocks():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20, cross_kv_blocks=4)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=8))
    runner.step()
    assert sched.kv.cross.num_free_blocks == 0
    sched.abort_requests(["a"])
    assert sched.kv.cross.num_free_blocks == 4 and sched.kv.cross.tables == {}


def test_a_request_larger_than_the_whole_pool_is_refused_at_admission():
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, cross_kv_blocks=7)
    items = (audio("x", 15), audio("y", 15))  # 8 blocks: could never fit 7
    with pytest.raises(RequestRejected, match="cross-attention pool of 7 blocks"):
        sched.add_request(make_request("a", 2, items=items))
    assert not sched.has_work()
    sched.add_request(make_request("b", 2, items=(audio("x", 15),)))  # 4 blocks fit


def test_a_prefix_hit_on_the_text_still_gets_its_cross_blocks():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20, cross_kv_blocks=8,
                           enable_prefix_caching=True)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 13, items=(audio("x"),), max_tokens=3))
    runner.run()
    sched.add_request(make_request("b", 13, items=(audio("x"),), max_tokens=3))
    out, _ = runner.step()
    (data,) = out.new_requests
    assert data.num_computed_tokens == 12  # three blocks of text from a
    assert len(data.cross_block_ids) == 4  # its own table all the same
    assert runner.derivations == 2  # the first chunk after the hit derived the cross K/V again
    runner.run()
    assert sched.kv.cross_stats()["used_blocks"] == 0


def test_without_a_cross_pool_nothing_is_tracked():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=2))
    out, _ = runner.step()
    assert out.new_requests[0].cross_block_ids == [] and sched.kv.cross_stats() is None
