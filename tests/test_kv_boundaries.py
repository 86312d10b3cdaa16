"""The KV accounting at its edges, torch-free (vlmd/sched/block_pool.py, kv_spec.py,
kv_managers.py, kv_manager.py).

Each case sits on a boundary that an off-by-one would move: the first token a window still
sees, the block a chunk leaves half full, a snapshot at a chunk's start, a block cached
twice, a pool of one block. Found by mutating these modules one operator at a time and
running the scheduler's tests: each case here fails under a mutant that they let through.
"""

from __future__ import annotations

import pytest

from sched_support import image, make_request
from vlmd.sched.block_pool import BlockPool
from vlmd.sched.encoder_cache import EncoderCacheManager
from vlmd.sched.kv_manager import KVCacheManager
from vlmd.sched.kv_spec import (
    CrossAttention,
    FullAttention,
    KVCacheConfig,
    RecurrentState,
    SharedKV,
    SlidingWindow,
    build_kv_cache_config,
    first_visible_block,
    layer_kinds,
    snapshot_positions,
)
from vlmd.sched.request import Request

SIZE = 4


def _request(request_id: str, num_prompt: int) -> Request:
    return Request(make_request(request_id, num_prompt))


def _kv(kinds, num_blocks: int, caching: bool = True, slot_bytes: int = 0) -> KVCacheManager:
    return KVCacheManager(build_kv_cache_config(kinds, SIZE, num_blocks, slot_bytes), enable_prefix_caching=caching)


# ---- the pool -------------------------------------------------------------------------------


def test_a_pool_of_one_block_serves_it_and_an_empty_pool_is_refused():
    pool = BlockPool(1)
    assert pool.allocate(1) == [0] and pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_blocks_taken_without_a_group_count_against_the_main_one():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.allocate_run(1, owner=1)
    assert pool.held_by == {0: 2, 1: 1}


def test_a_cached_block_keeps_its_first_key_and_a_key_its_first_block():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    pool.cache(first, (0, b"a"))
    pool.cache(first, (0, b"b"))  # already holds a prefix: not re-keyed
    assert pool.lookup((0, b"a")) == first and pool.lookup((0, b"b")) is None
    pool.cache(second, (0, b"a"))  # the key is taken: the second block stays unfindable
    assert pool.lookup((0, b"a")) == first
    pool.cache(second, (0, b"b"))
    assert pool.lookup((0, b"b")) == second


def test_a_run_skips_a_gap_at_its_second_block():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([0, 2, 3])  # 0 alone, then 2-3
    assert pool.allocate_run(2) == [2, 3]


def test_without_prefix_caching_no_block_counts_as_cached():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], (0, b"a"))
    pool.free(blocks)
    assert pool.lookup((0, b"a")) is None
    # A run starts at the lowest free block: none of them holds a prefix to spare.
    assert pool.allocate_run(2) == [0, 1]


# ---- the arithmetic of the KV model ---------------------------------------------------------


def test_the_first_block_a_window_still_sees():
    # A window of 10: a query at 12 sees tokens 3..12, so block 0 (tokens 0..3) is still read.
    assert first_visible_block(12, 10, SIZE) == 0
    assert first_visible_block(13, 10, SIZE) == 1  # sees 4..13
    assert first_visible_block(2, 1, SIZE) == 0 and first_visible_block(4, 1, SIZE) == 1  # a window of one token
    assert first_visible_block(3, 10, 1) == 0  # blocks of one token: the window has not moved yet


def test_snapshot_positions_at_their_edges():
    # The boundary before the last token when the last token starts a block.
    assert snapshot_positions([], 29, SIZE) == (28,)
    # An item that ends where the prompt ends: no snapshot at the prompt's end.
    assert snapshot_positions([(0, 8)], 8, SIZE) == (4,)
    # An item that ends inside the first block: no snapshot at position 0.
    assert snapshot_positions([(0, 2)], 10, SIZE) == (8,)
    # Blocks of one token: a snapshot at 1, after an item that ends there.
    assert snapshot_positions([(0, 1)], 3, 1) == (1, 2)
    # Avoiding items: a boundary where one item ends and the next begins is outside both.
    assert snapshot_positions([(0, 8), (8, 14)], 30, SIZE, avoid_inside_items=True) == (8, 28)


def test_a_window_as_long_as_the_model_keeps_every_block():
    assert layer_kinds(2, [None, 16], 0, max_model_len=16) == (FullAttention(), FullAttention())
    assert layer_kinds(2, [None, 15], 0, max_model_len=16) == (FullAttention(), SlidingWindow(15))


def test_shared_kv_reads_an_earlier_layer_only():
    config = build_kv_cache_config([FullAttention(), SharedKV(0)], SIZE, 8)
    assert config.layer_group == (0, 0) and config.layer_slot == (0, 0)
    with pytest.raises(ValueError, match="shares the K/V"):
        build_kv_cache_config([FullAttention(), SharedKV(1)], SIZE, 8)


def test_the_smallest_sizes_are_valid():
    assert SlidingWindow(1).window == 1 and RecurrentState(1).bytes_per_request == 1
    config = build_kv_cache_config([FullAttention(), RecurrentState(3)], 1, 8, slot_bytes=1)
    assert config.block_size == 1 and config.groups[1].blocks_per_request == 3
    for build in (lambda: SlidingWindow(0), lambda: RecurrentState(0),
                  lambda: build_kv_cache_config([FullAttention()], 0, 8),
                  lambda: build_kv_cache_config([FullAttention(), RecurrentState(3)], SIZE, 8, slot_bytes=0)):
        with pytest.raises(ValueError):
            build()


def test_the_config_counts_bytes_and_what_one_request_holds():
    kinds = [FullAttention(), FullAttention(), CrossAttention(), CrossAttention()]
    config = build_kv_cache_config(kinds, SIZE, 10, slot_bytes=100)
    assert config.page_bytes == 200 and config.bytes == 2000
    assert config.request_blocks(9) == [3, 0]  # no cross-attention tokens unless given
    assert config.request_blocks(9, 5) == [3, 2]
    assert config.max_concurrency(1) == 10.0  # one block a request
    assert [group.describe() for group in config.groups] == [
        {"group": 0, "kind": "full_attention", "layers": [0, 1]},
        {"group": 1, "kind": "cross_attention", "layers": [2, 3]},
    ]
    windowed = build_kv_cache_config([FullAttention(), SlidingWindow(8)], SIZE, 10)
    assert windowed.groups[1].describe() == {"group": 1, "kind": "sliding_window", "layers": [1], "window": 8}
    assert isinstance(config.with_blocks(3), KVCacheConfig) and config.with_blocks(3).bytes == 600


# ---- the managers ---------------------------------------------------------------------------


def test_a_chunk_that_ends_inside_a_block_leaves_that_block_unfindable():
    kv = _kv([FullAttention()], 40)
    first = _request("a", 40)
    assert kv.allocate_slots(first, 10) is not None  # blocks 0 and 1 full, block 2 holds 8..9
    first.num_computed_tokens = 10
    assert kv.computed_blocks(_request("b", 40)).num_blocks == 2
    assert kv.allocate_slots(first, 40) is not None
    assert kv.computed_blocks(_request("c", 40)).num_blocks == 9  # the last token is left to compute


def test_a_chunk_that_starts_at_a_snapshot_position_is_not_cut():
    kv = _kv([FullAttention(), RecurrentState(250)], 40, slot_bytes=100)
    request = _request("a", 20)  # a snapshot before the last token: at 16
    assert kv.chunk_limit(request, 0, 20) == 16
    assert kv.chunk_limit(request, 16, 4) == 4
    assert kv.chunk_limit(request, 8, 8) == 8  # ends at it: nothing to cut


def test_a_group_has_held_nothing_before_its_first_request():
    kv = _kv([FullAttention(), SlidingWindow(8)], 16)
    assert [group["peak_request_blocks"] for group in kv.group_stats()] == [0, 0]


def test_a_failed_steps_snapshot_is_dropped_and_never_found():
    kv = _kv([FullAttention(), RecurrentState(250)], 40, slot_bytes=100)  # a state: 3 pages
    request = _request("a", 20)
    assert kv.allocate_slots(request, 16) is not None  # 4 blocks, the state, a snapshot at 16
    assert [len(pages) for pages in kv.new_snapshots("a").values()] == [3]
    free = kv.num_free_blocks
    kv.forget_hashes_from("a", 0)  # the step raised: the snapshot was never written
    assert kv.new_snapshots("a") == {} and kv.num_free_blocks == free + 3
    kv.free("a")
    assert kv.computed_blocks(_request("b", 20)).num_blocks == 0 and kv.num_free_blocks == 40


def test_encoder_cache_usage_is_the_share_of_slots_taken():
    cache = EncoderCacheManager(10)
    assert cache.usage == 0.0
    cache.allocate("a", "img", 4)
    assert cache.usage == pytest.approx(0.4)
    assert EncoderCacheManager(0).usage == 0.0


def test_a_snapshot_is_due_where_this_prompt_has_none_though_the_block_before_has_one():
    kv = _kv([FullAttention(), RecurrentState(250)], 80, slot_bytes=100)
    first = Request(make_request("a", 20, items=(image("img", 0, 12),)))  # snapshots at 12 and 16
    for end in (12, 16, 20):
        assert kv.allocate_slots(first, end) is not None
        first.num_computed_tokens = end
    kv.free("a")
    # The same image, other text after it: a hit of the image's 12 tokens, from its snapshot.
    other = make_request("b", 20, items=(image("img", 0, 12),))
    other.prompt_token_ids[12:] = [900 + i for i in range(8)]
    second = Request(other)
    hit = kv.computed_blocks(second)
    assert hit.num_blocks == 3 and hit.state_sources
    second.num_computed_tokens = 12
    assert kv.allocate_slots(second, 16, hit) is not None
    # Its block 3 differs from the first prompt's: its snapshot at 16 is due and taken.
    assert [len(pages) for pages in kv.new_snapshots("b").values()] == [3]
