"""A sliding-window layer's decodes through the native decode kernel (``paged_decode.c``
with ``window``): each decode attends to its last ``window`` tokens only, read in place
through its window group's table, whose entries before the window are FREED (-1) or, once
given back, another sequence's blocks. Against a float64 reference of each sequence's own
K/V and against the torch path (``masked.attend_windowed``), in every kernel variant this
host runs; and the CPU backend takes the kernel for a windowed layer's decodes."""

from __future__ import annotations

import random

import pytest
import torch

from vlmd.layers.attention import SequenceChunk, paged_attention
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.attention.masked import attend_windowed, plan_window
from vlmd.layers.cpu import paged_decode as native_decode
from vlmd.layers.cpu.paged_decode import DecodeTables, paged_decode
from vlmd.sched.kv_managers import FREED

pytestmark = [
    pytest.mark.skipif(not native_decode.available(), reason="no kernel library was built in this install"),
    pytest.mark.usefixtures("each_kernel_variant"),
]


class WindowedDecodes:
    """Decodes of a windowed layer over one cache: each sequence's window group table holds
    real blocks from the window's first block on; the blocks before are FREED or (where
    ``reuse``) blocks of other sequences, as after the scheduler gave them back. Each
    sequence's true K/V are kept aside for the reference."""

    def __init__(self, lengths, window, block_size, *, heads=8, kv_heads=2, dim=64, reuse=False,
                 dtype=torch.float32, seed=0):
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        self.lengths, self.window, self.block_size = lengths, window, block_size
        needed = [-(-length // block_size) for length in lengths]
        pool = list(range(sum(needed) + 4))
        rng.shuffle(pool)
        slots = len(pool) * block_size
        self.k_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
        self.v_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
        self.q = torch.randn(len(lengths), heads, dim, generator=generator).to(dtype)
        self.tables, self.keys, self.values = [], [], []
        for length, count in zip(lengths, needed):
            first_block = max(0, length - window) // block_size  # the first block the window reads
            table = [FREED] * first_block + [pool.pop() for _ in range(count - first_block)]
            positions = torch.arange(length)
            real = positions >= first_block * block_size
            slots_of = torch.tensor([max(b, 0) for b in table])[positions // block_size] * block_size \
                + positions % block_size
            # What the sequence wrote there; positions before the window are gone from the cache.
            keys = torch.full((length, kv_heads, dim), float("nan"))
            values = torch.full((length, kv_heads, dim), float("nan"))
            keys[real], values[real] = self.k_cache[slots_of[real]].float(), self.v_cache[slots_of[real]].float()
            self.keys.append(keys)
            self.values.append(values)
            self.tables.append(table)
        if reuse:  # blocks given back were handed on at once: every FREED entry names a live block
            live = [b for table in self.tables for b in table if b != FREED]
            self.tables = [[rng.choice(live) if b == FREED else b for b in table] for table in self.tables]
        self.scale = dim ** -0.5

    def reference(self) -> torch.Tensor:
        """[B, H, D] in float64: each decode (position length - 1) against keys > it - window."""
        out = []
        for row, length in enumerate(self.lengths):
            first = max(0, length - self.window)
            group = self.q.shape[1] // self.keys[row].shape[1]
            keys = self.keys[row][first:].double().repeat_interleave(group, 1)
            values = self.values[row][first:].double().repeat_interleave(group, 1)
            scores = torch.einsum("hd,lhd->hl", self.q[row].double(), keys) * self.scale
            out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
        return torch.stack(out)

    def chunks(self) -> list[SequenceChunk]:
        # Described in the window group's tables (a windowed layer's metadata is its group's).
        return [SequenceChunk(table, length - 1, 1) for table, length in zip(self.tables, self.lengths)]

    def tables_for_kernel(self) -> DecodeTables:
        return DecodeTables.of(self.tables, list(self.lengths), self.block_size)


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("part_tokens", [0, 16])
def test_windowed_decodes_match_the_reference_and_the_torch_path(reuse, block_size, window, part_tokens):
    case = WindowedDecodes([1, 9, 40, 300, 77], window, block_size, reuse=reuse, seed=window + block_size)
    got = paged_decode(case.q, case.k_cache, case.v_cache, case.tables_for_kernel(), case.scale,
                       part_tokens=part_tokens, window=window)
    torch.testing.assert_close(got.double(), case.reference(), rtol=1e-5, atol=1e-5)
    plan = plan_window(case.chunks(), [], block_size, window)
    torch_path = attend_windowed(case.q, case.k_cache, case.v_cache, plan, len(case.lengths), case.scale)
    torch.testing.assert_close(got, torch_path, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,heads,kv_heads", [(32, 4, 2), (40, 6, 1), (256, 8, 4)])  # 40: the generic copy
def test_windowed_decodes_of_other_head_sizes_and_bfloat16_caches(dim, heads, kv_heads):
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        case = WindowedDecodes([30, 513, 64], 24, 16, heads=heads, kv_heads=kv_heads, dim=dim, reuse=True,
                               dtype=dtype, seed=dim)
        got = paged_decode(case.q, case.k_cache, case.v_cache, case.tables_for_kernel(), case.scale, window=24)
        torch.testing.assert_close(got.double(), case.reference(), rtol=tolerance, atol=tolerance)


def test_a_freed_block_inside_the_window_or_a_shared_prefix_is_refused():
    case = WindowedDecodes([40, 50], 20, 4)
    tables = case.tables_for_kernel()
    broken = tables.block_tables.clone()
    broken[0, (40 - 20) // 4] = FREED  # the window's first block
    with pytest.raises(ValueError, match="block id outside the cache"):
        paged_decode(case.q, case.k_cache, case.v_cache, DecodeTables(
            broken, tables.context_lens, 4, tables.group_offsets, tables.group_members, tables.group_tokens),
            case.scale, window=20)
    shared = DecodeTables.of(case.tables, [40, 50], 4, [([0, 1], 1)])
    with pytest.raises(ValueError, match="windowed layer"):
        paged_decode(case.q, case.k_cache, case.v_cache, shared, case.scale, window=20)
    with pytest.raises(ValueError, match="sliding window"):
        paged_decode(case.q, case.k_cache, case.v_cache, tables, case.scale, window=0)


@pytest.mark.parametrize("with_prefill", [False, True])
def test_the_cpu_backend_attends_a_windowed_layers_decodes_natively(monkeypatch, with_prefill):
    """CPUPagedBackend.forward with a window: the decodes through the kernel (one call),
    a prefill chunk of the same step still in torch; every row equals the torch backend's."""
    block_size, window = 4, 13
    case = WindowedDecodes([40, 26, 91], window, block_size, heads=4, kv_heads=2, dim=16, reuse=True, seed=3)
    chunks = case.chunks()
    rows = len(chunks)
    tables = [list(table) for table in case.tables]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    # This step's K/V rows of each decode (written by forward): the cache's own values there.
    positions = [length - 1 for length in case.lengths]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in enumerate(positions)]
    k, v = k_cache[slots].clone(), v_cache[slots].clone()
    q = case.q
    if with_prefill:  # a new sequence's first chunk of 6 tokens, in blocks of its own
        free = k_cache.shape[0] // block_size
        k_cache = torch.cat([k_cache, torch.zeros(2 * block_size, *k_cache.shape[1:])])
        v_cache = torch.cat([v_cache, torch.zeros(2 * block_size, *v_cache.shape[1:])])
        chunks.append(SequenceChunk([free, free + 1], 0, 6))
        generator = torch.Generator().manual_seed(9)
        q = torch.cat([q, torch.randn(6, 4, 16, generator=generator)])
        k = torch.cat([k, torch.randn(6, 2, 16, generator=generator)])
        v = torch.cat([v, torch.randn(6, 2, 16, generator=generator)])
    calls = []
    real = native_decode.paged_decode
    monkeypatch.setattr(native_decode, "paged_decode", lambda *a, **kw: calls.append(kw.get("window")) or real(*a, **kw))
    outputs = {}
    for kernels in ("auto", "torch"):
        backend = CPUPagedBackend(block_size, kernels)
        meta = backend.prepare_metadata(chunks, rows)
        outputs[kernels] = paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()), meta, case.scale, window)
    assert calls == [window]
    torch.testing.assert_close(outputs["auto"][:rows].double(), case.reference(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["auto"], outputs["torch"], rtol=1e-5, atol=1e-5)
