"""A linear-attention layer's state in its KV group's pages (vlmd/layers/linear_attention/state.py,
docs/decisions.md D105): what read_states gives back is what write_states stored, for each
sequence of a step, whatever the pool's dtype and wherever its pages lie; a fresh sequence
reads zeros; nothing outside a request's own pages in the layer's slot is touched."""

from __future__ import annotations

import pytest
import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.layers.attention.backend import SequenceChunk
from vlmd.layers.linear_attention.state import RecurrentStateLayout, commit_states, read_states, write_states
from vlmd.runner.kv_cache import allocate_kv_slots, layer_caches
from vlmd.types import KVSpec

BLOCK = 4
LAYOUT = RecurrentStateLayout(conv_channels=12, conv_kernel=4, heads=2, key_dim=4, value_dim=6)


def _pool(dtype: torch.dtype, num_blocks: int = 64):
    # Layers: recurrent, recurrent, full, full (pages of two slots: one group of each kind).
    spec = KVSpec(4, 2, 8, layer_state_bytes=(LAYOUT.bytes_per_request, LAYOUT.bytes_per_request, None, None))
    config = spec.kv_cache_config(BLOCK, torch.empty((), dtype=dtype).element_size(), 64, 64, num_blocks)
    slots = allocate_kv_slots(spec, config, dtype)
    return spec, config, slots, layer_caches(config, slots, range(4), spec)


def _meta(backend, config, tables_by_seq, starts, counts, num_decodes=0):
    chunks = [SequenceChunk.of(tables, start, count) for tables, start, count in zip(tables_by_seq, starts, counts)]
    return backend.prepare_metadata(chunks, num_decodes)


def test_layout_sizes():
    assert LAYOUT.conv_elements == 36 and LAYOUT.recurrent_elements == 48
    assert LAYOUT.elements == 84 and LAYOUT.bytes_per_request == 336
    odd = RecurrentStateLayout(conv_channels=1, conv_kernel=2, heads=1, key_dim=1, value_dim=2)
    assert odd.elements == 4  # 3 entries, rounded up to an even count
    with pytest.raises(ValueError, match="kernel - 1"):
        RecurrentStateLayout(conv_channels=4, conv_kernel=1, heads=1, key_dim=1, value_dim=1)


def test_kv_spec_declares_recurrent_groups():
    spec, config, _, _ = _pool(torch.float32)
    kinds = [group.kind.name for group in config.groups]
    assert kinds == ["full_attention", "recurrent_state"]
    recurrent = config.groups[1]
    assert recurrent.layers == (0, 1)
    # slot = K and V of a block in one layer slot: 2 * 4 * 2 * 8 * 4 bytes = 512; 336 fit in one
    assert config.slot_bytes == 512 and recurrent.blocks_per_request == 1
    assert spec.bytes_per_token(4) == 2 * 2 * 2 * 8 * 4  # only attention layers keep K/V per token
    with pytest.raises(ValueError, match="layer state sizes"):
        KVSpec(3, 2, 8, layer_state_bytes=(10,))
    # A 1:1 hybrid's pages have one slot: each recurrent layer is a group of its own.
    odd = KVSpec(3, 2, 8, layer_state_bytes=(100, 100, None)).kv_cache_config(BLOCK, 4, 64, 64, 8)
    assert [group.layers for group in odd.groups] == [(2,), (0,), (1,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_states_round_trip(dtype, split):
    spec, config, slots, caches = _pool(dtype)
    group = config.groups[1].index
    pages = config.groups[1].blocks_per_request
    backend = attention_backend_for("cpu", BLOCK, "torch")
    # A request's state pages: a run, or (split) ids far apart, which the layout must follow.
    state_pages = [[5 + i for i in range(pages)], [40 + 3 * i for i in range(pages)] if split else [20 + i for i in range(pages)]]
    tables = [{0: [1, 2], group: state_pages[0]}, {0: [3, 4], group: state_pages[1]}]
    before = [(k.clone(), v.clone()) for k, v in slots]
    meta = _meta(backend, config, tables, [3, 2], [1, 1], num_decodes=2)
    layer = caches[1]  # slot 1 of the recurrent group
    conv = torch.randn(2, 12, 3)
    recurrent = torch.randn(2, 2, 4, 6)
    write_states(layer, meta, LAYOUT, conv, recurrent)
    # Nothing is stored before the step has run (a re-run starts from the states before it).
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(slots, before))
    commit_states(meta)
    got_conv, got_recurrent = read_states(layer, meta, LAYOUT)
    assert torch.equal(got_conv, conv) and torch.equal(got_recurrent, recurrent)
    # Only the layer's own slot changed, and only in the requests' pages, in K and in V.
    for slot, ((k, v), (k0, v0)) in enumerate(zip(slots, before)):
        for new, old in ((k, k0), (v, v0)):
            changed = (new != old).flatten(1).any(dim=1).nonzero().flatten() // BLOCK
            if slot != 1:
                assert changed.numel() == 0
            else:
                assert set(changed.tolist()) <= set(state_pages[0]) | set(state_pages[1])
                assert changed.numel() > 0
    # Another layer of the group (slot 0) still reads its own (zero) state.
    other_conv, other_recurrent = read_states(caches[0], meta, LAYOUT)
    assert not other_conv.any() and not other_recurrent.any()


def test_a_fresh_sequence_reads_zeros():
    _, config, _, caches = _pool(torch.float32)
    group = config.groups[1].index
    backend = attention_backend_for("cpu", BLOCK, "torch")
    tables = [{0: [1, 2], group: [7]}]
    resumed = _meta(backend, config, tables, [4], [2])
    write_states(caches[0], resumed, LAYOUT, torch.ones(1, 12, 3), torch.ones(1, 2, 4, 6))
    commit_states(resumed)
    fresh = _meta(backend, config, tables, [0], [6])
    conv, recurrent = read_states(caches[0], fresh, LAYOUT)
    assert not conv.any() and not recurrent.any()
    conv, recurrent = read_states(caches[0], resumed, LAYOUT)
    assert conv.eq(1).all() and recurrent.eq(1).all()


def test_wrong_shapes_and_short_tables_are_refused():
    _, config, _, caches = _pool(torch.float32)
    group = config.groups[1].index
    backend = attention_backend_for("cpu", BLOCK, "torch")
    meta = _meta(backend, config, [{0: [1], group: [7]}], [2], [1], num_decodes=1)
    with pytest.raises(ValueError, match="states of shapes"):
        write_states(caches[0], meta, LAYOUT, torch.ones(2, 12, 3), torch.ones(2, 2, 4, 6))
    short = _meta(backend, config, [{0: [1], group: []}], [2], [1], num_decodes=1)
    with pytest.raises(RuntimeError, match="needs 1 pages"):
        read_states(caches[0], short, LAYOUT)


def test_a_layer_narrower_than_its_slot_is_refused():
    """A strided view of the slot's rows (a layer narrower than the slot, D111) cannot hold a
    state read as one flat vector: refused, never read half-wrong."""
    from vlmd.layers.attention.backend import LayerCache

    _, config, slots, _ = _pool(torch.float32)
    group = config.groups[1].index
    backend = attention_backend_for("cpu", BLOCK, "torch")
    k, v = slots[0]
    narrow = LayerCache(k.view(k.shape[0], 2, 8)[:, :1], v.view(v.shape[0], 2, 8)[:, :1], group)
    meta = _meta(backend, config, [{0: [1], group: [7]}], [2], [1], num_decodes=1)
    with pytest.raises(ValueError, match="narrower than the slot"):
        read_states(narrow, meta, LAYOUT)
