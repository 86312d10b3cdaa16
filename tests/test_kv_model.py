"""The KV model, torch-free: typed layer groups over one pool (vlmd/sched/kv_spec.py,
kv_managers.py, kv_manager.py; docs/decisions.md D91, D93, D95).

How layers are grouped; windows giving blocks back as they move, whatever the length;
prefix hits that every group serves; a block a window gave back serving any group; the
capacity that buys (a 3:1 windowed model holds ~3.5x the requests of the same layers all
full attention); recurrent state and shared K/V; then the scheduler driven by the fake
runner, which checks every step that the blocks a chunk's queries read are held, the same
in the runner and the scheduler.
"""

from __future__ import annotations

import random

import pytest

from sched_support import FakeRunner, image, make_request, make_scheduler
from vlmd.sched.block_pool import BlockPool, blocks_needed
from vlmd.sched.kv_manager import KVCacheManager
from vlmd.sched.kv_managers import FREED, window_hit_lengths
from vlmd.sched.kv_spec import (
    CrossAttention,
    FullAttention,
    RecurrentState,
    SharedKV,
    SlidingWindow,
    build_kv_cache_config,
    first_visible_block,
    layer_kinds,
    snapshot_positions,
    window_blocks_held,
)
from vlmd.sched.request import Request
from vlmd.types import KVSpec

SIZE, WINDOW = 4, 10
F, W = FullAttention(), SlidingWindow(WINDOW)


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


def _kv(kinds, num_blocks: int, caching: bool = False, slot_bytes: int = 0) -> KVCacheManager:
    return KVCacheManager(build_kv_cache_config(kinds, SIZE, num_blocks, slot_bytes), enable_prefix_caching=caching)


# ---- the groups -----------------------------------------------------------------------------


def test_the_arithmetic():
    assert first_visible_block(0, WINDOW, SIZE) == 0
    assert first_visible_block(9, WINDOW, SIZE) == 0  # sees 0..9
    assert first_visible_block(13, WINDOW, SIZE) == 1  # sees 4..13
    assert first_visible_block(14, WINDOW, SIZE) == 1  # sees 5..14: block 1 (4..7) partly
    assert window_blocks_held(100, WINDOW, SIZE) == 25 - first_visible_block(100, WINDOW, SIZE) == 3
    with pytest.raises(ValueError):
        SlidingWindow(0)


def test_layer_kinds_from_a_decoders_declaration():
    assert layer_kinds(4, [None, 10, None, 10], 0, 64) == (F, SlidingWindow(10), F, SlidingWindow(10))
    # A window past max_model_len frees nothing: its layers keep every block.
    assert layer_kinds(3, [None, 10, 99], 0, 64) == (F, SlidingWindow(10), F)
    assert layer_kinds(2, [10, 10], 0, 64) == (F, F)  # no full layer: one group, as before D91
    assert layer_kinds(2, [], 2, 64) == (F, F, CrossAttention(), CrossAttention())


def test_layers_of_each_kind_are_grouped_by_the_fewest_of_any_kind():
    # Gemma 3 4B's pattern: five sliding layers to a full one, 34 layers.
    kinds = [F if (layer + 1) % 6 == 0 else SlidingWindow(1024) for layer in range(34)]
    config = build_kv_cache_config(kinds, 16, 100, slot_bytes=10)
    assert config.num_slots == 5 and config.page_bytes == 50
    assert [(group.kind, len(group.layers)) for group in config.groups] == \
        [(F, 5)] + [(SlidingWindow(1024), 5)] * 5 + [(SlidingWindow(1024), 4)]
    assert config.groups[0].layers == (5, 11, 17, 23, 29)
    for layer in range(34):  # every layer has a slot in its group's pages, none shared
        group = config.groups[config.layer_group[layer]]
        assert group.layers[config.layer_slot[layer]] == layer
    # Whisper: every decoder layer self- and cross-attends: two groups of all of them.
    whisper = build_kv_cache_config(layer_kinds(4, [], 4, 448), 16, 10)
    assert [(group.kind, group.layers) for group in whisper.groups] == \
        [(F, (0, 1, 2, 3)), (CrossAttention(), (4, 5, 6, 7))]
    # A model of full-attention layers only: one group, a page holds every layer (as always).
    plain = build_kv_cache_config([F] * 9, 16, 10, slot_bytes=3)
    assert len(plain.groups) == 1 and plain.num_slots == 9 and plain.page_bytes == 27


def test_shared_kv_layers_hold_nothing_and_recurrent_state_is_sized_in_pages():
    kinds = [F, RecurrentState(250), RecurrentState(250), F, SharedKV(0), SharedKV(3)]
    config = build_kv_cache_config(kinds, SIZE, 50, slot_bytes=100)
    assert [(group.kind.name, group.layers) for group in config.groups] == \
        [("full_attention", (0, 3)), ("recurrent_state", (1, 2))]
    assert config.groups[1].blocks_per_request == 3  # 250 bytes in pages of 100 a slot
    assert (config.layer_group[4], config.layer_slot[4]) == (0, 0)  # layer 0's K/V
    assert (config.layer_group[5], config.layer_slot[5]) == (0, 1)  # layer 3's
    # What a request holds: full attention per token, the state once, shared layers nothing.
    assert config.request_blocks(40) == [10, 3]
    with pytest.raises(ValueError, match="earlier attention layer"):
        build_kv_cache_config([F, SharedKV(2), F], SIZE, 10)
    with pytest.raises(ValueError, match="earlier attention layer"):
        build_kv_cache_config([F, RecurrentState(8), SharedKV(1)], SIZE, 10, slot_bytes=4)
    with pytest.raises(ValueError, match="sized in pages"):
        build_kv_cache_config([F, RecurrentState(8)], SIZE, 10)


def test_a_recurrent_state_is_taken_once():
    kv = _kv([F, RecurrentState(250)], 40, caching=True, slot_bytes=100)
    first = _request("a", 20)
    assert [len(blocks) for blocks in _grow(kv, first, 8).values()] == [2, 3]
    assert _grow(kv, first, 20) == {0: [5, 6, 7]}  # the state does not grow with the length
    kv.free("a")
    # The same prompt again: full attention has it cached, but no chunk ended at a snapshot
    # position (the scheduler cuts chunks there: chunk_limit), so no state was kept: no hit.
    assert kv.computed_blocks(_request("b", 20)).num_blocks == 0
    assert kv.num_free_blocks == 40


def test_snapshot_positions():
    # An image at [3, 14) and a 30-token prompt, blocks of 4: after the image's last whole
    # block (12) and before the prompt's last token (28).
    assert snapshot_positions([(3, 14)], 30, 4) == (12, 28)
    assert snapshot_positions([(3, 14), (14, 20)], 30, 4) == (12, 20, 28)
    assert snapshot_positions([], 4, 4) == ()  # nothing before the last token's block
    assert snapshot_positions([(3, 14)], 30, 4, avoid_inside_items=True) == (28,)


def test_recurrent_snapshots_serve_later_prefix_hits():
    kv = _kv([F, RecurrentState(250)], 60, caching=True, slot_bytes=100)  # a state: 3 pages
    first = _request("a", 20)  # its snapshot position: 16
    assert kv.chunk_limit(first, 0, 20) == 16 and kv.chunk_limit(first, 16, 4) == 4
    new = _grow(kv, first, 16)
    assert [len(blocks) for blocks in new.values()] == [4, 3]
    snapshot = kv.new_snapshots("a")[1]
    assert len(snapshot) == 3 and not set(snapshot) & set(new[1])
    # Not findable before the step that fills it has run (the request's next allocation).
    assert kv.computed_blocks(_request("b", 20)).num_blocks == 0
    _grow(kv, first, 20)
    assert kv.new_snapshots("a") == {}
    again = _request("b", 20)
    hit = kv.computed_blocks(again)
    assert hit.num_blocks == 4 and hit.state_sources == {1: snapshot}
    again.num_computed_tokens = 16
    assert kv.allocate_slots(again, 20, hit) is not None
    kv.free("a")
    # The copy is not made yet: the snapshot's pages stay referenced until b's next step.
    assert kv.pool.count_unreferenced(snapshot) == 0
    kv.allocate_slots(again, 21)
    assert kv.pool.count_unreferenced(snapshot) == 3
    kv.free("b")
    assert kv.num_free_blocks == 60
    # A longer prompt with the same first 16 tokens starts there too.
    longer = _request("c", 40)
    assert kv.computed_blocks(longer).num_blocks == 4


def test_a_snapshot_of_a_step_that_failed_is_never_found():
    kv = _kv([F, RecurrentState(250)], 60, caching=True, slot_bytes=100)
    first = _request("a", 20)
    _grow(kv, first, 16)
    (snapshot,) = kv.new_snapshots("a").values()
    kv.forget_hashes_from("a", 0)  # the step raised for this request (Scheduler.fail_requests)
    kv.free("a")
    assert kv.computed_blocks(_request("b", 20)).num_blocks == 0
    assert kv.num_free_blocks == 60
    keys = kv._recurrent[0].page_keys(first.block_hashes[3])
    assert all(kv.pool.lookup(key) is None for key in keys)


def test_the_scheduler_ends_chunks_at_snapshots_and_starts_hits_from_them():
    layers = (F, RecurrentState(250))
    sched = make_scheduler(layers=layers, slot_bytes=100, enable_prefix_caching=True, num_kv_blocks=80,
                           max_model_len=64)
    runner = FakeRunner(sched)
    item = image("img", 3, 11)  # placeholders [3, 14): snapshots at 12 and 28 of 30 tokens
    sched.add_request(make_request("a", 30, items=(item,), max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 12} and set(out.state_snapshots["a"]) == {1}
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 16} and len(out.state_snapshots["a"][1]) == 3
    runner.run()
    # The same image with the same text: it starts from the state after 28 tokens.
    sched.add_request(make_request("b", 30, items=(image("img", 3, 11),), max_tokens=2))
    out, _ = runner.step()
    (data,) = out.new_requests
    assert data.num_computed_tokens == 28 and len(data.state_sources[1]) == 3
    runner.run()
    # Another question about the image (the text after it differs): it starts after the image.
    other = make_request("c", 30, items=(image("img", 3, 11),), max_tokens=2)
    other.prompt_token_ids[20:] = [900 + i for i in range(10)]
    sched.add_request(other)
    out, _ = runner.step()
    (data,) = out.new_requests
    assert data.num_computed_tokens == 12 and len(data.state_sources[1]) == 3
    runner.run()
    assert sched.kv.num_free_blocks == 80


def test_a_pool_short_of_a_snapshot_takes_none():
    kv = _kv([F, RecurrentState(250)], 8, caching=True, slot_bytes=100)
    first = _request("a", 20)
    assert kv.allocate_slots(first, 16) is not None  # 4 + 3 pages fit, 4 + 3 + 3 do not
    assert kv.new_snapshots("a") == {} and kv.num_free_blocks == 1


def test_no_snapshots_without_prefix_caching():
    kv = _kv([F, RecurrentState(250)], 60, caching=False, slot_bytes=100)
    first = _request("a", 20)
    assert kv.chunk_limit(first, 0, 20) == 20
    _grow(kv, first, 16)
    assert kv.new_snapshots("a") == {}


# ---- windows --------------------------------------------------------------------------------


def test_blocks_are_given_back_as_the_window_moves():
    kv = _kv([F, W], 64)
    request = _request("a", 8)
    assert _grow(kv, request, 8) == {0: [0, 1], 1: [2, 3]}
    for end in range(9, 41):  # decodes
        _grow(kv, request, end)
    # The next query is at 40: it sees 31..40, blocks 7..9 (of 10); 0..6 went back.
    table = kv.tables("a")[1]
    assert len(table) == 10 and table[:7] == [FREED] * 7 and FREED not in table[7:]
    assert len(kv.tables("a")[0]) == 10 and FREED not in kv.tables("a")[0]  # full attention keeps every block
    kv.release_out_of_window("a", 40)
    stats = kv.group_stats()[1]
    assert stats["used_blocks"] == 3 == window_blocks_held(40, WINDOW, SIZE)
    assert stats["peak_request_blocks"] <= (1 + WINDOW + 2 * SIZE - 3) // SIZE
    assert kv.num_free_blocks == 64 - 10 - 3
    kv.free("a")
    assert kv.group_stats()[1]["used_blocks"] == 0 and kv.num_free_blocks == 64


@pytest.mark.parametrize("seed", range(4))
def test_held_blocks_are_bounded_by_the_window_whatever_the_length(seed):
    rng = random.Random(seed)
    budget = 12
    kv = _kv([F, W], 800)
    request = _request("a", 1500)
    while request.num_computed_tokens < 1500:
        count = rng.randint(1, budget)
        _grow(kv, request, min(1500, request.num_computed_tokens + count))
        assert kv.group_stats()[1]["used_blocks"] <= (count + WINDOW + 2 * SIZE - 3) // SIZE
    peak = kv.config.peak_request_blocks(1500, budget)
    assert kv.group_stats()[1]["peak_request_blocks"] <= peak[1] < peak[0] == 1500 // SIZE
    assert len(kv.tables("a")[0]) == 1500 // SIZE  # the full group grows with the length


def test_a_block_a_window_gives_back_serves_the_full_group_next():
    """One pool: the window's dead blocks are capacity for any group at once."""
    kv = _kv([F, W], 12)
    request = _request("a", 28)
    _grow(kv, request, 12)
    _grow(kv, request, 24)  # 6 + 6 blocks: the pool is full
    assert kv.num_free_blocks == 0
    window_blocks = set(kv.tables("a")[1][:3])
    # The next query (at 24) sees 15..24: the window's blocks 0..2 go back first, and the
    # full group's seventh block is one of them; the window takes another for its own.
    new = _grow(kv, request, 28)
    assert kv.tables("a")[1][:3] == [FREED] * 3
    assert new[0][0] in window_blocks and new[1][0] in window_blocks
    assert kv.num_free_blocks == 1


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
    kv = _kv([F, W], 24, caching=True)
    _finish_one(kv, "first", 32)  # 8 full blocks cached in both groups; the window's freed ones too
    second = _request("second", 40)
    hit = kv.computed_blocks(second)
    assert hit.num_blocks == 8
    # Its first query (position 32) sees 23..32: blocks 5..7 adopted, 0..4 never held.
    assert hit.tables[1][:5] == [FREED] * 5 and FREED not in hit.tables[1][5:]
    assert len(hit.tables[0]) == 8 and FREED not in hit.tables[0]
    second.num_computed_tokens = 32
    assert kv.allocate_slots(second, 40, hit) is not None
    assert kv.group_stats()[1]["used_blocks"] == len(kv.tables("second")[1]) - 5 == 5
    kv.free("second")

    # Another prompt takes every free block (evicting the cached ones, the window's first,
    # freed longest ago): no group-wide hit of the first prompt is left.
    hog = _request("hog", 48, first_token=5000)
    assert _grow(kv, hog, 44) is not None
    assert kv.computed_blocks(_request("third", 40)).num_blocks == 0
    kv.free("hog")


def test_a_hit_falls_back_to_the_longest_one_every_group_serves():
    kv = _kv([F, W], 64, caching=True)
    _finish_one(kv, "first", 32)
    probe = _request("probe", 40)
    kv.computed_blocks(probe)  # hashes its blocks
    window_block = kv.pool.lookup((1, probe.block_hashes[6]))
    kv.pool.forget_hash(window_block)  # block 6 gone from the window group
    assert kv.pool.lookup((0, probe.block_hashes[6])) is not None  # not from the full group
    hit = kv.computed_blocks(_request("again", 40))
    # 8 blocks need 5..7, 7 need 4..6: both miss 6; 6 blocks need 3..5: served.
    assert hit.num_blocks == 6 and hit.tables[1][:3] == [FREED] * 3


# ---- capacity ------------------------------------------------------------------------------


def _most_decoding(layers, slot_blocks: int, prompt: int, requests: int = 30, budget: int = 2048) -> tuple[int, int]:
    """The most requests decoding at once (each past its prompt, so holding its decoding
    size), and the preemptions, for ``requests`` of ``prompt`` tokens on a pool of
    ``slot_blocks`` one-layer blocks' worth of memory (a page holds ``num_slots`` of them)."""
    probe = build_kv_cache_config(layers, 16, 1)
    sched = make_scheduler(num_kv_blocks=slot_blocks // probe.num_slots, block_size=16, layers=layers,
                           max_num_seqs=256, max_num_batched_tokens=budget, max_model_len=2048)
    runner = FakeRunner(sched)
    for index in range(requests):
        sched.add_request(make_request(f"r{index}", prompt, max_tokens=32, ignore_eos=True))
    most = 0
    while sched.has_work():
        runner.step()
        most = max(most, sum(1 for request in sched.running if request.num_computed_tokens >= prompt))
    return most, sched.num_preemptions


def test_windows_turn_into_capacity_close_to_what_they_allow():
    """The issue's case: three windowed layers (window 32) to one full, ~1,450-token requests,
    the same memory: the windowed model holds ~3.5x the requests of the same layers all full,
    and as many as the pool holds at their decoding size (the figure `vlmd cost` states)."""
    windowed = [SlidingWindow(32), SlidingWindow(32), SlidingWindow(32), F]
    memory, prompt = 2400, 1450  # one-layer blocks of 16 tokens
    all_full, _ = _most_decoding([F] * 4, memory, prompt)
    with_windows, _ = _most_decoding(windowed, memory, prompt)
    config = build_kv_cache_config(windowed, 16, memory)  # one slot a page: 2,400 pages
    assert config.request_blocks(prompt + 32) == \
        [blocks_needed(prompt + 32, 16)] + [window_blocks_held(prompt + 32, 32, 16)] * 3 == [93, 3, 3, 3]
    full_config = build_kv_cache_config([F] * 4, 16, memory // 4)  # four slots a page: 600 pages
    assert all_full == int(full_config.max_concurrency(prompt + 32)) == 600 // 93 == 6
    figure = int(config.max_concurrency(prompt + 32))
    assert figure == 2400 // 102 == 23
    # A request's first chunk (its whole prompt, in a 2,048-token budget) takes its blocks in
    # every group at once, before the windows give most back: a little short of the figure.
    assert figure - 3 <= with_windows <= figure
    assert with_windows >= 3.5 * all_full


def test_a_request_that_cannot_fit_alone_is_refused_and_one_that_can_waits():
    with pytest.raises(ValueError, match="one request of max_model_len"):
        make_scheduler(num_kv_blocks=10, block_size=SIZE, layers=[F, W], max_model_len=40)
    sched = make_scheduler(num_kv_blocks=16, block_size=SIZE, layers=[F, W], max_model_len=40,
                           max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    for index in range(3):
        sched.add_request(make_request(f"r{index}", 20, max_tokens=20, ignore_eos=True))
    runner.run()
    assert sched.num_preemptions > 0  # 3 x 40 tokens do not fit 16 blocks of 4 and the windows
    assert sched.kv.num_free_blocks == 16 and sched.kv.group_stats()[1]["used_blocks"] == 0
    for index in range(3):
        assert len(runner.output_tokens(f"r{index}")) == 20


@pytest.mark.parametrize("seed", range(3))
def test_the_scheduler_keeps_every_window_it_reads(seed):
    """Random prompts sharing prefixes, chunked, with prefix caching, two windows and full
    layers over one pool small enough to preempt: every step the fake runner checks each
    chunk's tables in every group (sched_support.FakeRunner), and every block comes back."""
    rng = random.Random(seed)
    seqs, budget = 4, 24
    sched = make_scheduler(num_kv_blocks=90, block_size=SIZE, max_num_seqs=seqs, max_num_batched_tokens=budget,
                           enable_prefix_caching=True, max_model_len=128,
                           layers=[W, F, SlidingWindow(17), W, F, SlidingWindow(17)])
    assert len(sched.config.kv_cache.groups) == 3
    runner = FakeRunner(sched)
    for index in range(12):
        request = make_request(f"r{index}", rng.randint(5, 90), max_tokens=rng.randint(1, 30), ignore_eos=True)
        runner.sched.add_request(request)
        if rng.random() < 0.5:
            runner.step()
    runner.run()
    assert sched.kv.prefix_hits > 0
    assert all(group["used_blocks"] == 0 for group in sched.kv.group_stats())
    assert sched.kv.num_free_blocks == 90


def test_layers_from_a_kv_spec_size_the_pool_pages():
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, layer_windows=(24, None, 24, None))
    config = spec.kv_cache_config(block_size=16, dtype_bytes=4, max_model_len=1024, max_num_batched_tokens=40)
    assert config.num_slots == 2 and config.slot_bytes == 2 * 16 * 2 * 8 * 4
    # By default the pool holds one request of max_model_len at its most: 64 + 5 blocks.
    assert config.num_blocks == 64 + (40 + 24 + 2 * 16 - 3) // 16 == 69


def test_a_run_is_taken_from_blocks_that_hold_no_cached_prefix_first():
    pool = BlockPool(12)
    held = pool.allocate(4)  # 0..3
    for index, block in enumerate(held):
        pool.cache(block, (0, bytes([index])))
    pool.free(held)  # cached, free: a later request's prefix hit
    assert pool.allocate_run(3, owner=1) == [4, 5, 6]
    assert all(pool.lookup((0, bytes([index]))) == index for index in range(4))
    # No uncached run left that long: a cached run is taken (its hashes forgotten).
    assert pool.allocate_run(5, owner=1) == [7, 8, 9, 10, 11] and pool.allocate_run(3, owner=1) == [0, 1, 2]
    assert pool.lookup((0, bytes([0]))) is None
