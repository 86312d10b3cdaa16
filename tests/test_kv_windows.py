"""Window groups of the KV manager, torch-free: sliding-window layers hold only the blocks
their window can still see (vlmd/sched/kv_groups.py, docs/decisions.md D91).

The manager alone (blocks given back as the window moves, bounded whatever the length,
prefix hits that every group serves, preemption and finish freeing every group), then the
scheduler driven by the fake runner, which checks each step that the blocks a chunk's
queries read are held, the same in the runner and the scheduler.
"""

from __future__ import annotations

import random

import pytest

from sched_support import FakeRunner, make_request, make_scheduler
from vlmd.sched.kv_groups import (
    FREED,
    WindowGroup,
    first_visible_block,
    separate_windows,
    window_blocks_held,
    window_hit_lengths,
    window_pool_blocks,
)
from vlmd.sched.kv_manager import KVCacheManager
from vlmd.sched.request import Request

SIZE, WINDOW = 4, 10


def _request(request_id: str, num_prompt: int, first_token: int = 100) -> Request:
    engine_request = make_request(request_id, num_prompt)
    engine_request.prompt_token_ids = [first_token + i for i in range(num_prompt)]
    return Request(engine_request)


def _grow(kv: KVCacheManager, request: Request, end: int):
    """The scheduler's order: the chunk starts at num_computed_tokens; then it is computed."""
    new = kv.allocate_slots(request, end)
    assert new is not None
    request.num_computed_tokens = end
    return new


def test_the_arithmetic():
    assert first_visible_block(0, WINDOW, SIZE) == 0
    assert first_visible_block(9, WINDOW, SIZE) == 0  # sees 0..9
    assert first_visible_block(13, WINDOW, SIZE) == 1  # sees 4..13
    assert first_visible_block(14, WINDOW, SIZE) == 1  # sees 5..14: block 1 (4..7) partly
    assert window_blocks_held(100, WINDOW, SIZE) == 25 - first_visible_block(100, WINDOW, SIZE) == 3
    assert window_pool_blocks(WINDOW, SIZE, max_num_seqs=2, max_num_batched_tokens=8) == (8 + 2 * 15) // 4
    assert separate_windows([None, 10, None, 10], 64) == (10,)
    assert separate_windows([None, 10, 99], 64) == (10,)  # a window past max_model_len frees nothing
    assert separate_windows([10, 10], 64) == ()  # no full layer: one group, as before
    with pytest.raises(ValueError):
        WindowGroup(0, 4)


def test_blocks_are_given_back_as_the_window_moves():
    kv = KVCacheManager(64, SIZE, enable_prefix_caching=False, window_groups=[WindowGroup(WINDOW, 16)])
    request = _request("a", 8)
    assert _grow(kv, request, 8) == [0, 1]
    assert kv.window_block_ids("a") == {WINDOW: [0, 1]}
    for end in range(9, 41):  # decodes
        _grow(kv, request, end)
    # The next query is at 40: it sees 31..40, blocks 7..9 (of 10); 0..6 went back.
    table = kv.window_block_ids("a")[WINDOW]
    assert len(table) == 10 and table[:7] == [FREED] * 7 and FREED not in table[7:]
    assert kv.block_ids("a") == list(range(10))  # the full-attention layers keep every block
    kv.release_out_of_window("a", 40)
    stats = kv.window_stats()[0]
    assert stats["used_blocks"] == 3 == window_blocks_held(40, WINDOW, SIZE)
    assert stats["peak_request_blocks"] <= (1 + WINDOW + 2 * SIZE - 3) // SIZE
    kv.free("a")
    assert kv.window_stats()[0]["used_blocks"] == 0 and kv.num_free_blocks == 64


@pytest.mark.parametrize("seed", range(4))
def test_held_blocks_are_bounded_by_the_window_whatever_the_length(seed):
    rng = random.Random(seed)
    budget = 12
    kv = KVCacheManager(400, SIZE, enable_prefix_caching=False,
                        window_groups=[WindowGroup(WINDOW, window_pool_blocks(WINDOW, SIZE, 1, budget))])
    request = _request("a", 1500)
    while request.num_computed_tokens < 1500:
        count = rng.randint(1, budget)
        _grow(kv, request, min(1500, request.num_computed_tokens + count))
        held = kv.window_stats()[0]["used_blocks"]
        assert held <= (count + WINDOW + 2 * SIZE - 3) // SIZE
    assert kv.window_stats()[0]["peak_request_blocks"] <= window_pool_blocks(WINDOW, SIZE, 1, budget)
    assert len(kv.block_ids("a")) == 1500 // SIZE  # the main group grows with the length


def test_which_hits_a_window_group_serves():
    # Blocks of 4, window 10: a hit of k blocks needs blocks first_visible_block(4k) .. k-1.
    assert window_hit_lengths([True] * 6, WINDOW, SIZE) == [True] * 7
    # Block 1 missing: hits of 1 and 2 blocks need it (2 sees 0..7, 3 sees 3..11 needs 0..2).
    valid = window_hit_lengths([True, False, True, True, True, True], WINDOW, SIZE)
    assert valid == [True, True, False, False, False, True, True]


def _finish_one(kv: KVCacheManager, request_id: str, tokens: int, first_token: int = 100) -> None:
    request = _request(request_id, tokens, first_token)
    for end in range(SIZE, tokens + 1, SIZE):
        _grow(kv, request, end)
    kv.free(request_id)


def test_a_prefix_hit_needs_the_window_before_its_end():
    kv = KVCacheManager(64, SIZE, window_groups=[WindowGroup(WINDOW, 16)])
    _finish_one(kv, "first", 32)  # 8 full blocks cached in both groups; the window's freed ones too
    second = _request("second", 40)
    hit = kv.computed_blocks(second)
    assert hit.num_blocks == 8
    # Its first query (position 32) sees 23..32: blocks 5..7 adopted, 0..4 never held.
    assert hit.windows[WINDOW][:5] == [FREED] * 5 and FREED not in hit.windows[WINDOW][5:]
    second.num_computed_tokens = 32
    assert kv.allocate_slots(second, 40, hit) is not None
    assert kv.window_stats()[0]["used_blocks"] == len(kv.window_block_ids("second")[WINDOW]) - 5 == 5
    kv.free("second")

    # Another prompt takes every free window block (evicting the cached ones): no window
    # group can serve any hit of the first prompt now, although its main blocks are cached.
    hog = _request("hog", 64, first_token=5000)
    assert kv.allocate_slots(hog, 64) is not None
    third = _request("third", 40)
    assert kv.computed_blocks(third).num_blocks == 0
    kv.free("hog")


def test_a_hit_falls_back_to_the_longest_one_every_group_serves():
    kv = KVCacheManager(64, SIZE, window_groups=[WindowGroup(WINDOW, 24)])
    _finish_one(kv, "first", 32)
    window_pool = kv._windows[0].pool
    probe = _request("probe", 40)
    kv.computed_blocks(probe)  # hashes its blocks
    hashes = probe.block_hashes
    window_pool.forget_hash(window_pool.lookup(hashes[6]))  # block 6 gone from the window group
    hit = kv.computed_blocks(_request("again", 40))
    # 8 blocks need 5..7, 7 need 4..6: both miss 6; 6 blocks need 3..5: served.
    assert hit.num_blocks == 6 and hit.windows[WINDOW][:3] == [FREED] * 3


def test_preemption_and_finish_free_every_group():
    sched = make_scheduler(num_kv_blocks=12, block_size=SIZE, max_model_len=48, max_num_batched_tokens=16,
                           window_groups=(WindowGroup(WINDOW, 12),))
    runner = FakeRunner(sched)
    for index in range(3):
        sched.add_request(make_request(f"r{index}", 20, max_tokens=20, ignore_eos=True))
    runner.run()
    assert sched.num_preemptions > 0  # 3 x 40 tokens do not fit 12 blocks of 4
    assert sched.kv.num_free_blocks == 12 and sched.kv.window_stats()[0]["used_blocks"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_scheduler_keeps_every_window_it_reads(seed):
    """Random prompts sharing prefixes, chunked, with prefix caching: every step the fake
    runner checks each chunk's window tables (sched_support.FakeRunner), and the window
    group, sized to its worst case, never preempts anything."""
    rng = random.Random(seed)
    seqs, budget = 4, 24
    window_blocks = window_pool_blocks(WINDOW, SIZE, seqs, budget)
    sched = make_scheduler(num_kv_blocks=200, block_size=SIZE, max_num_seqs=seqs, max_num_batched_tokens=budget,
                           enable_prefix_caching=True, window_groups=(WindowGroup(WINDOW, window_blocks),))
    runner = FakeRunner(sched)
    for index in range(12):
        request = make_request(f"r{index}", rng.randint(5, 90), max_tokens=rng.randint(1, 30), ignore_eos=True)
        runner.sched.add_request(request)
        if rng.random() < 0.5:
            runner.step()
    runner.run()
    assert sched.num_preemptions == 0
    assert sched.kv.prefix_hits > 0
    assert sched.kv.window_stats()[0]["used_blocks"] == 0
