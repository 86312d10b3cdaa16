"""Cross-attention K/V as a group of the KV model, without torch (sched/kv_managers.py,
WholeRequestManager; docs/decisions.md D93, D95).

A request's cross table is taken whole, from the one pool every group shares, when it is
first scheduled, held unchanged for its life, freed when it finishes or is preempted; a
request whose table does not fit waits, never fails or over-allocates; one that could never
fit the whole pool is refused at admission. The fake runner (sched_support) checks at every
step that each scheduled request's tables are whole, the same on both sides, never shared.
"""

from __future__ import annotations

import pytest

from sched_support import make_request, make_scheduler
from test_scheduler_encoder_decoder import EncoderDecoderRunner, audio
from vlmd.errors import RequestRejected
from vlmd.sched.block_pool import BlockPool
from vlmd.sched.cross_kv import cross_tokens_of, is_consecutive
from vlmd.sched.kv_spec import CrossAttention, FullAttention
from vlmd.types import MultiModalItem

# One self-attention layer and one cross-attention layer: two groups over one pool.
WITH_CROSS = (FullAttention(), CrossAttention())
CROSS = 1  # the cross-attention group's index


def _cross_used(sched) -> int:
    return sched.kv.group_stats()[CROSS]["used_blocks"]


def test_the_pool_hands_out_consecutive_runs_where_it_has_them():
    pool = BlockPool(10)
    assert pool.allocate_run(3, owner=1) == [0, 1, 2]
    assert pool.allocate_run(3, owner=1) == [3, 4, 5]
    assert pool.allocate_run(2, owner=1) == [6, 7]
    pool.free([3, 4, 5])
    assert pool.num_free_blocks == 5 and pool.held_by[1] == 5
    assert pool.allocate_run(2) == [3, 4]  # the lowest run that fits
    assert pool.allocate_run(2) == [8, 9]  # [5] alone is too short
    assert pool.held_by[0] == 4


def test_a_fragmented_pool_still_allocates():
    pool = BlockPool(6)
    for _ in range(6):
        pool.allocate(1)
    pool.free([1])
    pool.free([3])
    pool.free([5])
    table = pool.allocate_run(3)
    assert sorted(table) == [1, 3, 5] and not is_consecutive(sorted(table))
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.allocate_run(1)
    assert pool.allocate_run(0) == []


def test_cross_tokens_are_those_of_the_items_without_placeholders():
    items = [audio("x", 15), MultiModalItem(modality="image", identifier="i", offset=3, length=4)]
    assert cross_tokens_of(items) == 15
    assert cross_tokens_of([]) == 0


def test_a_request_takes_its_whole_table_at_its_first_chunk_and_keeps_it():
    # 15 encoder tokens in blocks of 4: 4 blocks, taken with the first of several chunks.
    sched = make_scheduler(max_num_batched_tokens=4, max_num_encoder_input_tokens=20, encoder_cache_size=20,
                           num_kv_blocks=16, layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 10, items=(audio("x"),), max_tokens=3))
    out, _ = runner.step()
    (data,) = out.new_requests
    assert len(data.block_tables[CROSS]) == 4 and is_consecutive(data.block_tables[CROSS])
    assert len(data.block_tables[0]) == 1
    stats = sched.kv.group_stats()[CROSS]
    assert (stats["kind"], stats["used_blocks"], stats["peak_request_blocks"]) == ("cross_attention", 4, 4)
    out, _ = runner.step()
    assert out.new_requests == [] and CROSS not in out.cached_requests[0].new_block_ids  # nothing more
    assert sched.kv.tables("a")[CROSS] == data.block_tables[CROSS]
    runner.run()
    assert _cross_used(sched) == 0 and sched.kv.num_free_blocks == 16  # finished: every block back


def test_a_request_waits_while_the_pool_cannot_hold_its_table():
    # 11 blocks: a and b take 1 + 4 each; c would need 5 with one free: it waits, then takes a's.
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, num_kv_blocks=11,
                           layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=2))
    sched.add_request(make_request("b", 2, items=(audio("y"),), max_tokens=6))
    sched.add_request(make_request("c", 2, items=(audio("z"),), max_tokens=2))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and [r.request_id for r in sched.waiting] == ["c"]
    assert sched.kv.num_free_blocks == 1 and _cross_used(sched) == 8
    a_blocks = set(sched.kv.tables("a")[0] + sched.kv.tables("a")[CROSS])
    out, _ = runner.step()  # a samples its second token and finishes
    assert "c" not in out.num_scheduled_tokens
    out, _ = runner.step()  # a's blocks are free: c takes them
    assert [data.request_id for data in out.new_requests] == ["c"]
    assert set(out.new_requests[0].block_tables[CROSS]) <= a_blocks | {10}
    runner.run()
    assert _cross_used(sched) == 0 and sched.num_preemptions == 0
    assert runner.output_tokens("c") == [7, 7]


def test_a_text_only_request_holds_no_cross_blocks_and_is_not_held_up():
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, num_kv_blocks=6,
                           max_model_len=16, layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=4))
    sched.add_request(make_request("text", 3, max_tokens=2))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"a", "text"}
    assert sched.kv.tables("text")[CROSS] == [] and sched.kv.num_free_blocks == 0
    runner.run()


def test_preemption_gives_the_cross_blocks_back_and_the_resume_takes_them_again():
    # 16 blocks: three requests of 4 cross blocks growing to 3 blocks of text cannot all stay.
    sched = make_scheduler(num_kv_blocks=16, max_num_encoder_input_tokens=45, encoder_cache_size=45,
                           max_model_len=40, layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    for name, identifier in (("a", "x"), ("b", "y"), ("c", "x")):
        sched.add_request(make_request(name, 2, items=(audio(identifier),), max_tokens=8))
    seen_preempted = False
    while sched.has_work():
        out, _ = runner.step()
        for request in sched.waiting:
            if request.num_preemptions:
                seen_preempted = True
                assert sched.kv.tables(request.request_id)[CROSS] == []  # freed with its text blocks
        held = sum(len(sched.kv.tables(r.request_id)[CROSS]) for r in sched.running)
        assert _cross_used(sched) == held == 4 * len(sched.running)
    assert seen_preempted and sched.num_preemptions > 0
    assert runner.derivations == 3 + sched.num_preemptions
    for name in "abc":
        assert runner.output_tokens(name) == [7] * 8
    assert _cross_used(sched) == 0 and sched.kv.num_free_blocks == 16


def test_an_abort_frees_the_cross_blocks():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20, num_kv_blocks=8,
                           layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=8))
    runner.step()
    assert sched.kv.num_free_blocks == 3 and _cross_used(sched) == 4
    sched.abort_requests(["a"])
    assert sched.kv.num_free_blocks == 8 and _cross_used(sched) == 0


def test_a_request_larger_than_the_whole_pool_is_refused_at_admission():
    sched = make_scheduler(max_num_encoder_input_tokens=60, encoder_cache_size=60, num_kv_blocks=10,
                           max_model_len=8, layers=WITH_CROSS)
    items = (audio("x", 15), audio("y", 15))  # 8 cross blocks and up to 2 of text: could never fit 9
    with pytest.raises(RequestRejected, match="more than the server's whole KV cache of 10 blocks"):
        sched.add_request(make_request("a", 2, items=items + (audio("z", 4),), max_tokens=4))
    assert not sched.has_work()
    sched.add_request(make_request("b", 2, items=items, max_tokens=4))  # 8 + 2 blocks fit


def test_a_prefix_hit_on_the_text_still_gets_its_cross_blocks():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20, num_kv_blocks=16,
                           enable_prefix_caching=True, layers=WITH_CROSS)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 13, items=(audio("x"),), max_tokens=3))
    runner.run()
    sched.add_request(make_request("b", 13, items=(audio("x"),), max_tokens=3))
    out, _ = runner.step()
    (data,) = out.new_requests
    assert data.num_computed_tokens == 12  # three blocks of text from a
    assert len(data.block_tables[CROSS]) == 4  # its own table all the same
    assert runner.derivations == 2  # the first chunk after the hit derived the cross K/V again
    runner.run()
    assert _cross_used(sched) == 0


def test_without_cross_attention_layers_there_is_no_cross_group():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=2))
    out, _ = runner.step()
    assert set(out.new_requests[0].block_tables) == {0} and len(sched.kv.group_stats()) == 1


def test_a_cross_table_is_a_run_where_the_free_blocks_have_one():
    """The runner reads a consecutive cross table as a view (no gather every step): the
    manager takes the lowest run of free blocks, not the least recently freed ones."""
    from vlmd.sched.kv_manager import KVCacheManager
    from vlmd.sched.kv_spec import build_kv_cache_config
    from vlmd.sched.request import Request

    kv = KVCacheManager(build_kv_cache_config(WITH_CROSS, 4, 8), enable_prefix_caching=False)
    for name in ("r1", "r2"):  # blocks 0-3 and 4-7, given back tail first: free 3 2 1 0 7 6 5 4
        assert kv.allocate_slots(Request(make_request(name, 16)), 16) is not None
    kv.free("r1")
    kv.free("r2")
    speech = Request(make_request("a", 2, items=(audio("x"),)))
    new = kv.allocate_slots(speech, 2)
    assert new[0] == [3]  # text takes the block freed longest ago
    assert new[CROSS] == [4, 5, 6, 7] and is_consecutive(new[CROSS])  # not [2, 1, 0, 7]
