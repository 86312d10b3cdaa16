"""The scheduler's managers on their own: block pool, KV tables, encoder-cache slots."""

from __future__ import annotations

import pytest

from sched_support import make_request
from vlmd.sched.block_pool import BlockPool
from vlmd.sched.encoder_cache import EncoderCacheManager
from vlmd.sched.kv_manager import KVCacheManager
from vlmd.sched.kv_spec import FullAttention, build_kv_cache_config


# ---- block pool and KV manager -----------------------------------------------------------


def test_block_pool_reuses_the_block_freed_longest_ago():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.free([1])
    pool.free([0])
    # 3 was never used, then 1, then 0: oldest free first.
    assert pool.allocate(3) == [3, 1, 0]
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free([2, 3])
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [2, 3]


def test_block_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_kv_manager_grows_tables_and_frees_tail_first():
    kv = KVCacheManager(build_kv_cache_config([FullAttention()], 4, 6), enable_prefix_caching=False)
    a, b = make_request("a", 4), make_request("b", 4)
    assert kv.allocate_slots(a, 5) == {0: [0, 1]}
    assert kv.allocate_slots(a, 8) == {}  # still two blocks
    assert kv.allocate_slots(a, 9) == {0: [2]}
    assert kv.tables("a")[0] == [0, 1, 2]
    assert kv.allocate_slots(b, 13) is None  # four needed, three free: nothing taken
    assert kv.num_free_blocks == 3 and kv.tables("b")[0] == []
    kv.free("a")
    assert kv.num_free_blocks == 6 and kv.tables("a")[0] == []
    # Never-used blocks first, then a's tail before its head.
    assert kv.allocate_slots(b, 24) == {0: [3, 4, 5, 2, 1, 0]}
    kv.free("missing")  # harmless


# ---- encoder cache manager ------------------------------------------------------------


def test_encoder_cache_acquire_release_and_lru_eviction():
    cache = EncoderCacheManager(cache_size=30)
    assert not cache.acquire_if_resident("r1", "x")
    assert cache.can_allocate(10, encoder_budget=30, pending_tokens=0)
    cache.allocate("r1", "x", 10)
    cache.allocate("r1", "y", 10)
    cache.allocate("r2", "z", 10)
    assert cache.num_free_slots == 0 and cache.num_freeable_slots == 0 and cache.usage == 1.0
    assert cache.acquire_if_resident("r3", "x")  # shared: no new slots
    cache.record_lookups(2, 1)  # the scheduler counts once per scheduled chunk
    assert cache.num_queries == 2 and cache.num_hits == 1

    assert not cache.can_allocate(10, encoder_budget=30, pending_tokens=0)  # all held
    cache.release("r1", "x")  # r3 still holds x
    assert cache.num_freeable_slots == 0
    cache.release("r1", "y")
    cache.release("r2", "z")
    cache.release("r3", "x")
    cache.release("r3", "x")  # twice: no-op
    cache.release("nobody", "z")  # not a holder: no-op
    assert cache.num_free_slots == 0 and cache.num_freeable_slots == 30
    assert all(cache.is_resident(i) for i in "xyz")  # released outputs stay until evicted

    # y was released first, then z, then x: y goes first, and only as much as needed.
    assert cache.can_allocate(10, encoder_budget=10, pending_tokens=0)
    assert cache.take_evicted() == ["y"]
    assert cache.take_evicted() == []
    assert not cache.is_resident("y") and cache.num_free_slots == 10

    # Re-acquiring an unused output protects it from eviction.
    assert cache.acquire_if_resident("r4", "z")
    assert cache.num_freeable_slots == 20
    assert cache.can_allocate(10, encoder_budget=20, pending_tokens=10)  # 10 promised + 10 more
    assert cache.take_evicted() == ["x"]
    assert cache.is_resident("z")


def test_encoder_cache_respects_budget_and_pending():
    cache = EncoderCacheManager(cache_size=20)
    assert not cache.can_allocate(11, encoder_budget=10, pending_tokens=0)
    assert cache.can_allocate(10, encoder_budget=10, pending_tokens=10)
    assert not cache.can_allocate(10, encoder_budget=10, pending_tokens=11)
    assert cache.take_evicted() == []
    assert EncoderCacheManager(0).usage == 0.0
