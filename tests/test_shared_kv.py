"""Layers that read another layer's K/V (``SharedKV``, D111) and layers of different head
sizes over one pool: the declaration (``KVSpec``), the KV model it makes, the runner's layer
caches and the attention backends' read-only path, against a plain reference."""

from __future__ import annotations

import pytest
import torch

from vlmd.layers.attention import LayerCache, SequenceChunk, paged_attention, shared_attention
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.attention.flex import FlexBackend
from vlmd.runner.kv_cache import allocate_kv_slots, layer_caches
from vlmd.sched.kv_spec import FullAttention, SharedKV, SlidingWindow, layer_kinds
from vlmd.types import KVSpec

F = FullAttention()


def _gemma4_like(num_layers=10, shared=4, window=64) -> KVSpec:
    """Four sliding layers to a full one; the last ``shared`` layers read the last earlier
    layer of their type (transformers' Gemma 4 ``kv_sharing_modes``); full layers twice as wide."""
    windows = tuple(None if (layer + 1) % 5 == 0 else window for layer in range(num_layers))
    first_shared = num_layers - shared
    last_owner = {w: max(layer for layer in range(first_shared) if windows[layer] == w) for w in set(windows)}
    sources = tuple(None if layer < first_shared else last_owner[windows[layer]] for layer in range(num_layers))
    dims = tuple(32 if w is None else 16 for w in windows)
    return KVSpec(num_layers=num_layers, num_kv_heads=2, head_dim=16, layer_windows=windows,
                  layer_kv_sources=sources, layer_head_dims=dims)


def test_shared_layers_hold_nothing_in_the_kv_model():
    spec = _gemma4_like()  # layers 6..9 share: 6, 7, 8 read layer 5 (sliding), 9 reads layer 4 (full)
    assert spec.layer_kv_sources == (None,) * 6 + (5, 5, 5, 4)
    kinds = layer_kinds(10, spec.layer_windows, 0, 1024, layer_kv_sources=spec.layer_kv_sources)
    assert kinds[:6] == (SlidingWindow(64),) * 4 + (F, SlidingWindow(64))
    assert kinds[6:] == (SharedKV(5), SharedKV(5), SharedKV(5), SharedKV(4))
    config = spec.kv_cache_config(16, 4, 1024, 256)
    owned = sorted(layer for group in config.groups for layer in group.layers)
    assert owned == [0, 1, 2, 3, 4, 5]  # no group holds a shared layer
    for layer, source in ((6, 5), (7, 5), (8, 5), (9, 4)):
        assert (config.layer_group[layer], config.layer_slot[layer]) == \
            (config.layer_group[source], config.layer_slot[source])
    # The pool's slot holds the widest layer (2 heads x 32); only the 6 owners cost anything.
    assert spec.slot_width == 64 and spec.num_layers_with_kv == 6
    assert spec.bytes_per_token(4) == 2 * 6 * 2 * 32 * 4
    assert config.slot_bytes == 2 * 16 * 2 * 32 * 4
    # Without sharing the same layers would need a slot for each of the ten.
    plain = KVSpec(num_layers=10, num_kv_heads=2, head_dim=32, layer_windows=spec.layer_windows)
    assert plain.bytes_per_token(4) == 2 * 10 * 2 * 32 * 4
    assert sum(len(group.layers) for group in plain.kv_cache_config(16, 4, 1024, 256).groups) == 10


@pytest.mark.parametrize("num_layers, sources, windows, dims, match", [
    (3, (None, 2, None), (), (), "not an earlier layer"),
    (3, (None, 0, 1), (), (), "not an earlier layer"),  # a chain: 1 keeps nothing of its own
    (2, (None, 0), (None, 8), (), "window or head size"),
    (2, (None, 0), (), (16, 32), "window or head size"),
    (2, (None,), (), (), "K/V sources for 2 layers"),
])
def test_bad_sharing_declarations_are_refused(num_layers, sources, windows, dims, match):
    with pytest.raises(ValueError, match=match):
        KVSpec(num_layers=num_layers, num_kv_heads=1, head_dim=16, layer_windows=windows, layer_kv_sources=sources,
               layer_head_dims=dims)


def test_layer_caches_give_a_shared_layer_its_sources_tensors_and_narrow_layers_a_view():
    spec = _gemma4_like()
    config = spec.kv_cache_config(4, 4, 1024, 64, num_blocks=6)
    slots = allocate_kv_slots(spec, config, torch.float32)
    assert len(slots) == config.num_slots and slots[0][0].shape == (24, 64)
    caches = layer_caches(config, slots, range(spec.num_layers), spec)
    for layer, source in ((6, 5), (9, 4)):
        assert caches[layer][0].data_ptr() == caches[source][0].data_ptr()
        assert caches[layer][1].data_ptr() == caches[source][1].data_ptr()
        assert caches[layer].group == caches[source].group
    assert caches[0][0].shape == (24, 2, 16) and caches[4][0].shape == (24, 2, 32)
    # A narrow layer writes the first 2 x 16 of a row's 64 values: its rows stay its rows.
    caches[0][0][5] = 1.0
    slot = slots[config.layer_slot[0]][0]
    assert slot[5, :32].eq(1).all() and slot[5, 32:].eq(0).all() and slot[4].eq(0).all()


def test_layers_of_other_kv_head_counts_view_the_first_values_of_each_row():
    """Gemma 4's attention_k_eq_v full layers: one K/V head of 64 where the windowed layers
    have two of 16; the slot's rows hold 64 values, each layer its heads x head size of them."""
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, layer_windows=(8, None, 8),
                  layer_head_dims=(16, 64, 16), layer_kv_heads=(2, 1, 2))
    assert spec.slot_width == 64 and spec.bytes_per_token(4) == 2 * 3 * 64 * 4
    config = spec.kv_cache_config(4, 4, 64, 16, num_blocks=3)
    slots = allocate_kv_slots(spec, config, torch.float32)
    caches = layer_caches(config, slots, range(3), spec)
    assert [tuple(cache[0].shape) for cache in caches] == [(12, 2, 16), (12, 1, 64), (12, 2, 16)]
    caches[1][1][2, 0, 63] = 5.0  # the full layer's last value of row 2
    assert slots[config.layer_slot[1]][1][2, 63] == 5.0
    with pytest.raises(ValueError, match="K/V head counts"):
        KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, layer_kv_heads=(2, 1))


def _reference(q_rows, keys, values, positions, window, scale):
    """[n, H, D] queries at ``positions`` against a sequence's [L, Hkv, D] K/V, float64."""
    length = keys.shape[0]
    mask = torch.tensor([[key <= query and (window is None or key > query - window) for key in range(length)]
                         for query in positions])
    group = q_rows.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    weights = torch.softmax((torch.einsum("nhd,lhd->hnl", q_rows.double(), k) * scale).masked_fill(~mask, float("-inf")),
                            dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, v)


@pytest.mark.parametrize("backend_kind", ["auto", "torch", "flex"])
@pytest.mark.parametrize("window", [None, 5])
def test_a_shared_layer_attends_over_its_sources_kv_and_writes_nothing(backend_kind, window):
    """Two sequences prefilled in chunks, then decoded: each step the source layer writes and
    attends (``paged_attention``), the sharing layer attends with its own queries
    (``shared_attention``) over the same cache, a narrow view of a wider slot in KV group 1
    (its own tables, not the main group's); the cache is the same before and after the
    sharing layer, and both layers equal the reference."""
    block_size, heads, kv_heads, dim, slot_dim = 4, 4, 2, 16, 32
    backend = FlexBackend(block_size, "flex") if backend_kind == "flex" else CPUPagedBackend(block_size, backend_kind)
    generator = torch.Generator().manual_seed(7)
    lengths = [19, 13]
    tables = [[5, 0, 8, 2, 9], [3, 7, 1, 6]]  # group 1's, where these layers keep their K/V
    main_tables = [[10, 11, 4, 3, 7], [8, 2, 0, 5]]  # group 0's: never written here
    slot = (torch.zeros(12 * block_size, kv_heads, slot_dim), torch.zeros(12 * block_size, kv_heads, slot_dim))
    cache = LayerCache(slot[0][..., :dim], slot[1][..., :dim], 1)
    keys = [torch.randn(n, kv_heads, dim, generator=generator) for n in lengths]
    values = [torch.randn(n, kv_heads, dim, generator=generator) for n in lengths]
    source_q = [torch.randn(n, heads, dim, generator=generator) for n in lengths]
    shared_q = [torch.randn(n, heads, dim, generator=generator) for n in lengths]
    scale = dim ** -0.5
    steps = [[(0, 0, 7), (1, 0, 6)], [(0, 7, 9), (1, 6, 5)], [(0, 16, 1), (1, 11, 1)], [(0, 17, 1), (1, 12, 1)],
             [(0, 18, 1)]]
    for pieces in steps:
        pieces = sorted(pieces, key=lambda piece: piece[2] != 1 or piece[1] == 0)  # decodes first
        chunks = [SequenceChunk.of({0: main_tables[seq], 1: tables[seq]}, start, count) for seq, start, count in pieces]
        meta = backend.prepare_metadata(chunks, sum(1 for _, start, count in pieces if count == 1 and start > 0))
        rows = lambda tensors: torch.cat([tensors[seq][start:start + count] for seq, start, count in pieces])  # noqa: E731
        source_out = paged_attention(rows(source_q), rows(keys), rows(values), cache, meta, scale, window)
        before = (slot[0].clone(), slot[1].clone())
        shared_out = shared_attention(rows(shared_q), cache, meta, scale, window)
        assert torch.equal(slot[0], before[0]) and torch.equal(slot[1], before[1])
        assert slot[0][..., dim:].eq(0).all()  # the wider part of the slot untouched
        row = 0
        for seq, start, count in pieces:
            end = start + count
            for queries, out in ((source_q, source_out), (shared_q, shared_out)):
                expected = _reference(queries[seq][start:end], keys[seq][:end], values[seq][:end],
                                      list(range(start, end)), window, scale)
                torch.testing.assert_close(out[row:row + count].double(), expected, atol=1e-4, rtol=1e-4)
            row += count
