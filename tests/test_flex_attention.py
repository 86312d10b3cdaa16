"""The CUDA attention backend (``vlmd/layers/attention/flex.py``) run on the CPU.

FlexAttention runs eagerly on the CPU, applying the mask_mod to every key; CUDA's kernel
reads only the blocks the block mask lists. So each case checks both halves: the output
against the paged backend's torch path and a float64 reference, and the block lists
against the mask_mod evaluated densely (every visible key's block listed, every "full"
block wholly visible). Then the graph-bucket choice (torch-free), the graphs' buffer
refill and their step body (CPU: no capture), and one tiny LLaVA served with the backend
forced against the default server's greedy tokens.

With ``VLMD_TEST_DEVICE=cuda`` (contrib/device/check.sh) the parity cases run on the GPU,
through the compiled kernel, against the same float64 reference (blocks of 16 there: the
kernel's smallest KV tile).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from conftest import Server, image_message, random_image
from vlmd.layers.attention import LayerCache, SequenceChunk, attention_backend_for
from vlmd.layers.attention.backend import MAIN_GROUP
from vlmd.layers.attention.cpu_paged import CPUPagedBackend
from vlmd.layers.attention.flex import (
    QUERY_TILE,
    FlexBackend,
    FlexMetadata,
    copy_group,
    fill,
    flex_group,
    flex_kernel_options,
    run_flex,
    structure_decode_step,
    tile_blocks,
)
from vlmd.layers.attention.graph_buckets import bucket_for, graph_buckets
from vlmd.layers.attention.masked import visibility
from vlmd.sched.kv_managers import FREED

WINDOW_GROUP = 1  # the windowed layers' KV group in these tests (the main group is 0)

DEVICE = torch.device(os.environ["VLMD_TEST_DEVICE"] if os.environ.get("VLMD_TEST_DEVICE", "").startswith("cuda")
                      else "cpu")
BLOCK = 16 if DEVICE.type == "cuda" else 4
CACHE_BLOCKS = 96


def tables(rng: random.Random, lengths: list[int]) -> list[list[int]]:
    """Disjoint tables of shuffled block ids, each covering its length (plus a spare block)."""
    pool = list(range(CACHE_BLOCKS))
    rng.shuffle(pool)
    return [[pool.pop() for _ in range(-(-length // BLOCK) + 1)] for length in lengths]


def windowed(table: list[int], start: int, window: int) -> list[int]:
    """A window group's table: the blocks wholly before the step's first query's window freed."""
    first_live = max(0, start - window + 1) // BLOCK
    return [FREED] * first_live + table[first_live:]


def step_inputs(chunks, heads, kv_heads, dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(chunk.count for chunk in chunks)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=generator).to(dtype)
    cache = tuple(torch.randn(CACHE_BLOCKS * BLOCK, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tuple(part.to(DEVICE) for part in cache)


def reference(q, cache, chunks, scale, window):
    """Float64 attention of every row, keys read through each chunk's table (cache already written)."""
    k_cache, v_cache = (part.cpu().double() for part in cache)
    q = q.cpu()
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for chunk in chunks:
        table = chunk.tables[WINDOW_GROUP] if window is not None else chunk.block_ids
        end = chunk.start + chunk.count
        first_key = 0 if window is None else max(0, chunk.start - window + 1)
        keys_at = torch.arange(first_key, end)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in keys_at.tolist()])
        allowed = visibility(torch.arange(chunk.start, end), keys_at, chunk.spans, window)  # [n, L]
        group = q.shape[1] // k_cache.shape[1]
        keys = k_cache[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache[slots].repeat_interleave(group, dim=1)
        queries = q[row:row + chunk.count].double()
        scores = torch.einsum("nhd,lhd->hnl", queries, keys) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[row:row + chunk.count] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        row += chunk.count
    return out


def block_mask_agrees(group, window) -> None:
    """The block lists CUDA's kernel reads against the mask_mod, densely: a block holding a
    visible key of a tile is listed; a block listed full is visible to every query of the tile."""
    mask = group.block_mask
    count, query_length = len(group.rows), group.query_length
    device = mask.kv_indices.device
    b = torch.arange(count, device=device).view(-1, 1, 1)
    q = torch.arange(query_length, device=device).view(1, -1, 1)
    kv = torch.arange(group.cache_tokens, device=device).view(1, 1, -1)
    dense = mask.mask_mod(b, torch.zeros_like(b), q, kv).cpu()  # [B, n, keys]
    for member, (first, end) in enumerate(group.rows):
        real = end - first
        for tile in range(-(-real // QUERY_TILE)):
            rows = dense[member, tile * QUERY_TILE: min(real, (tile + 1) * QUERY_TILE)]
            by_block = rows.view(rows.shape[0], -1, BLOCK)
            visible = set(torch.nonzero(by_block.any(dim=(0, 2))).flatten().tolist())
            whole = set(torch.nonzero(by_block.all(dim=(0, 2))).flatten().tolist())
            partial = set(mask.kv_indices[member, 0, tile, : mask.kv_num_blocks[member, 0, tile]].tolist())
            full = set(mask.full_kv_indices[member, 0, tile, : mask.full_kv_num_blocks[member, 0, tile]].tolist())
            assert visible <= partial | full, f"member {member} tile {tile}: visible blocks not listed"
            assert full <= whole, f"member {member} tile {tile}: a block listed full is not wholly visible"
            assert not partial & full


def run_both(chunks, num_decodes, *, heads=4, kv_heads=2, dim=16, dtype=torch.float32, window=None, seed=0):
    """(flex output, torch-path output, float64 reference, the flex metadata)."""
    q, k, v, cache = step_inputs(chunks, heads, kv_heads, dim, dtype, seed)
    scale = dim ** -0.5
    # A windowed layer's cache belongs to the window's KV group: the backend reads its tables.
    group = MAIN_GROUP if window is None else WINDOW_GROUP
    flex = FlexBackend(BLOCK)
    flex_cache = LayerCache(*(part.clone() for part in cache), group)
    meta = flex.prepare_metadata(chunks, num_decodes)
    flex_out = flex.forward(q, k, v, flex_cache, meta, scale, window)
    # The paged backend's torch path on the CPU (its prefill kernel is the CPU's flash attention).
    torch_path = CPUPagedBackend(BLOCK, "torch")
    torch_cache = LayerCache(*(part.cpu().clone() for part in cache), group)
    torch_meta = torch_path.prepare_metadata(chunks, num_decodes)
    torch_out = torch_path.forward(q.cpu(), k.cpu(), v.cpu(), torch_cache, torch_meta, scale, window)
    assert torch.equal(flex_cache[0].cpu(), torch_cache[0]) and torch.equal(flex_cache[1].cpu(), torch_cache[1])
    plan = meta.for_group(group).plan(window, CACHE_BLOCKS, DEVICE)
    for group in (plan.decodes, plan.prefills):
        if group is not None:
            block_mask_agrees(group, window)
    return flex_out, torch_out, reference(q, flex_cache, chunks, scale, window), meta


def assert_close(flex_out, torch_out, expected, dtype=torch.float32):
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert flex_out.dtype == dtype and flex_out.device == DEVICE
    flex_out = flex_out.cpu()
    assert torch.allclose(flex_out.double(), expected, atol=tolerance, rtol=tolerance), \
        float((flex_out.double() - expected).abs().max())
    assert torch.allclose(flex_out.float(), torch_out.float(), atol=tolerance, rtol=tolerance)


def decodes(rng, contexts, window=None):
    chunks = []
    for table, start in zip(tables(rng, [c + 1 for c in contexts]), contexts):
        groups = {MAIN_GROUP: table, WINDOW_GROUP: windowed(table, start, window)} if window is not None else None
        chunks.append(SequenceChunk(table, start, 1, tables=groups))
    return chunks


def prefills(rng, shapes, spans=None, window=None):
    """``shapes``: (start, count) per chunk; ``spans``: per chunk."""
    chunks = []
    spans = spans or [()] * len(shapes)
    for table, (start, count), chunk_spans in zip(tables(rng, [s + c for s, c in shapes]), shapes, spans):
        groups = {MAIN_GROUP: table, WINDOW_GROUP: windowed(table, start, window)} if window is not None else None
        chunks.append(SequenceChunk(table, start, count, chunk_spans, groups))
    return chunks


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_decodes(heads, kv_heads):
    rng = random.Random(1)
    chunks = decodes(rng, [1, 7, 16, 45])
    assert_close(*run_both(chunks, 4, heads=heads, kv_heads=kv_heads)[:3])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_prefill_chunks_with_context(heads, kv_heads):
    rng = random.Random(2)
    # One chunk longer than a query tile (two tiles), one inside a block, one block-aligned.
    chunks = prefills(rng, [(13, QUERY_TILE + 22), (5, 2), (8, 8)])
    assert_close(*run_both(chunks, 0, heads=heads, kv_heads=kv_heads)[:3])


def test_mixed_step():
    rng = random.Random(3)
    mixed = decodes(rng, [3, 30]) + prefills(rng, [(9, 14), (0, 11)])
    flex_out, torch_out, expected, meta = run_both(mixed, 2)
    assert_close(flex_out, torch_out, expected)
    plan = meta.plan(None, CACHE_BLOCKS, DEVICE)
    # The chunk without context takes SDPA; the other two groups FlexAttention.
    assert [rows for rows, _ in plan.fresh] == [(16, 27)]
    assert plan.decodes.rows == [(0, 1), (1, 2)] and plan.prefills.rows == [(2, 16)]


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    rng = random.Random(4)
    chunks = decodes(rng, [2, 19, 40], window) + prefills(rng, [(21, 9), (0, 23), (3, QUERY_TILE + 4)],
                                                          window=window)
    flex_out, torch_out, expected, meta = run_both(chunks, 3, window=window, heads=6, kv_heads=2)
    assert_close(flex_out, torch_out, expected)


def test_bidirectional_spans():
    rng = random.Random(5)
    # A span wholly in a fresh chunk; one in a chunk with context; one begun in the context;
    # one across two query tiles (its later keys are listed for the first tile by the span alone).
    chunks = prefills(rng, [(0, 12), (6, 14), (10, 10), (5, QUERY_TILE + 22)],
                      spans=[((2, 9),), ((8, 15),), ((8, 15), (16, 20)), ((QUERY_TILE - 3, QUERY_TILE + 12),)])
    assert_close(*run_both(chunks, 0)[:3])


def test_spans_under_a_window():
    rng = random.Random(6)
    chunks = prefills(rng, [(0, 20), (7, 16), (5, QUERY_TILE + 22)],
                      spans=[((3, 14),), ((9, 21),), ((QUERY_TILE - 3, QUERY_TILE + 12),)], window=6)
    assert_close(*run_both(chunks, 0, window=6)[:3])


@pytest.mark.parametrize("window", [None, 7])
def test_bfloat16_caches(window):
    rng = random.Random(7)
    chunks = decodes(rng, [4, 33], window) + prefills(rng, [(11, 13), (0, 9)], window=window)
    flex_out, torch_out, expected, _ = run_both(chunks, 2, dtype=torch.bfloat16, window=window, heads=8, kv_heads=2)
    assert_close(flex_out, torch_out, expected, torch.bfloat16)


def test_tile_blocks_lists_only_what_is_visible():
    # Queries 10..13 of a causal layer, blocks of 4: blocks 0-1 wholly before the first
    # query, block 2 (8..11) on the diagonal, block 3 (12..15) partly visible.
    blocks = tile_blocks(10, 4, (), None, 4)
    assert blocks.full == [[0, 1]] and blocks.partial == [[2, 3]]
    # A window of 3: keys > position - 3, so 8..13 at most; block 0 unread, block 1 (4..7) too.
    blocks = tile_blocks(10, 4, (), 3, 4)
    assert blocks.full == [[]] and blocks.partial == [[2, 3]]


def test_tables_are_read_in_one_place():
    """This module reads a chunk's table in one function (its group's: for_group chose it)."""
    import inspect

    from vlmd.layers.attention import flex

    source = inspect.getsource(flex)
    assert source.count(".block_ids") == 1 and ".tables" not in source


def test_freed_window_entry_inside_the_window_is_refused():
    chunk = SequenceChunk.of({MAIN_GROUP: [1, 2, 3], WINDOW_GROUP: [FREED, FREED, 3]}, 9, 1)
    meta = FlexBackend(BLOCK).prepare_metadata([chunk], 1).for_group(WINDOW_GROUP)
    with pytest.raises(ValueError, match="outside the cache"):
        meta.plan(8, CACHE_BLOCKS, DEVICE)


def test_kernel_tile_for_the_cache_block():
    cuda = torch.device("cuda")
    assert flex_kernel_options(16, cuda) == {"BLOCK_N": 16}
    assert flex_kernel_options(32, cuda) == {"BLOCK_N": 32}
    assert flex_kernel_options(128, cuda) == {"BLOCK_N": 64}
    assert flex_kernel_options(8, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        flex_kernel_options(8, cuda)


def test_registry_picks_flex_by_flag_and_on_cuda():
    assert isinstance(attention_backend_for("cpu", 16, "flex"), FlexBackend)
    assert isinstance(attention_backend_for("cpu", 16, "auto"), CPUPagedBackend)
    assert isinstance(attention_backend_for("cuda", 16, "auto"), FlexBackend)
    assert isinstance(attention_backend_for("cuda:1", 16, "flex"), FlexBackend)
    assert isinstance(attention_backend_for("cuda", 16, "torch"), CPUPagedBackend)
    with pytest.raises(ValueError, match="attention kernels"):
        FlexBackend(16, "fast")


# Graph buckets: torch-free.

def test_graph_buckets():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(6) == (1, 2, 4, 6)
    assert graph_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=">= 1"):
            graph_buckets(bad)


def test_bucket_for_takes_the_smallest_that_holds_the_step():
    buckets = graph_buckets(32)
    assert [bucket_for(batch, buckets) for batch in (1, 2, 3, 5, 8, 9, 17, 25, 32)] == [1, 2, 4, 8, 8, 16, 24, 32, 32]
    assert bucket_for(33, buckets) is None
    with pytest.raises(ValueError):
        bucket_for(0, buckets)
    # Padding: at most 7 rows up to 32 decodes, 15 past that.
    buckets = graph_buckets(256)
    assert max(bucket_for(b, buckets) - b for b in range(1, 33)) == 7
    assert max(bucket_for(b, buckets) - b for b in range(33, 257)) == 15


def test_a_graph_buffer_refilled_from_a_step_attends_as_the_step():
    """What a replay reads: the whole-cache (static) buffers of a bucket, refilled from a
    later step's narrower plan, padded rows copying the first decode."""
    rng = random.Random(8)
    first, later = decodes(rng, [3, 9, 14]), decodes(rng, [40, 21, 6])
    device = DEVICE
    padded = later + [later[0]]
    members = [((row, row + 1), chunk) for row, chunk in enumerate(padded)]
    static = flex_group([((row, row + 1), chunk) for row, chunk in enumerate(first + [first[0]])], None, BLOCK,
                        CACHE_BLOCKS, device, static=True)
    step = flex_group(members, None, BLOCK, CACHE_BLOCKS, device)
    assert static.cache_tokens == CACHE_BLOCKS * BLOCK and step.cache_tokens < static.cache_tokens
    copy_group(static, step)
    q, _, _, (k_cache, v_cache) = step_inputs(padded, 4, 2, 16, torch.float32, seed=9)
    queries = q.new_empty(4, 4, 1, 16)
    fill(queries, q[:3].unsqueeze(2), 3)
    heads_first = lambda cache, tokens: cache[:tokens].permute(1, 0, 2).unsqueeze(0)
    options = flex_kernel_options(BLOCK, DEVICE)
    replayed = run_flex(queries, heads_first(k_cache, static.cache_tokens), heads_first(v_cache, static.cache_tokens),
                        static.block_mask, 0.25, options, static=True)
    stepped = run_flex(queries, heads_first(k_cache, step.cache_tokens), heads_first(v_cache, step.cache_tokens),
                       step.block_mask, 0.25, options)
    assert torch.allclose(replayed, stepped, atol=1e-6)
    assert torch.equal(replayed[3], replayed[0])  # the padding row is the first decode again
    expected = reference(q[:3], (k_cache, v_cache), later, 0.25, None)
    assert torch.allclose(replayed[:3, :, 0].cpu().double(), expected, atol=1e-5)


def test_decode_step_body_equals_the_modules(tiny_llava_dir):
    """``structure_decode_step`` (what a CUDA graph captures) against the model's own
    modules, one decode step of three sequences after their prompts, on the CPU."""
    from vlmd.engine.builder import load_model
    from vlmd.testing.greedy_steps import language_model

    lm = language_model(load_model(str(tiny_llava_dir), torch.float32, linear_kernels="plain"))
    spec = lm.kv_spec
    block = 16
    backend = FlexBackend(block)
    caches = [tuple(torch.zeros(40 * block, spec.num_kv_heads, spec.head_dim) for _ in range(2))
              for _ in range(spec.num_layers)]
    rng = random.Random(10)
    prompts = [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 21, 40)]
    sequences = [SequenceChunk(list(range(1 + 10 * i, 11 + 10 * i)), 0, len(p)) for i, p in enumerate(prompts)]
    with torch.inference_mode():
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        lm(lm.embed_input_ids(ids), positions, backend.prepare_metadata(sequences, 0), caches)
        step = [SequenceChunk(chunk.block_ids, chunk.count, 1) for chunk in sequences]
        embeds = lm.embed_input_ids(torch.tensor([7, 8, 9]))
        step_positions = torch.tensor([len(p) for p in prompts])
        cos, sin = lm.rotary.cos_sin(step_positions, embeds.dtype)
        module_caches = [tuple(part.clone() for part in pair) for pair in caches]
        modules = lm(embeds, step_positions, backend.prepare_metadata(step, 3), module_caches)
        body = structure_decode_step(backend, lm.decoder_structure, embeds, cos[:, 0], sin[:, 0],
                                     backend.prepare_metadata(step, 3), caches)
    assert backend.decode_steps == {"fused": 0, "modules": 1, "fused_chunks": 0}  # the graphs never engage on the CPU
    assert torch.allclose(body, modules, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(caches, module_caches))


# End to end: the tiny LLaVA served with the flex backend forced on the CPU.

@pytest.fixture(scope="module")
def flex_server(tiny_llava_dir, tmp_path_factory):
    # Steps of 128 tokens: an image's 576 are prefilled in chunks after cached context.
    server = Server(tiny_llava_dir, "--attention-kernels", "flex", "--max-model-len", "2048",
                    "--num-kv-blocks", "256", "--max-num-batched-tokens", "128",
                    log_dir=tmp_path_factory.mktemp("flex-logs"))
    yield server
    server.stop()


def test_flex_server_generates_the_default_servers_greedy_tokens(flex_server, llava_server):
    from concurrent.futures import ThreadPoolExecutor

    cases = [image_message("Describe the picture.", random_image(3, 200, 150)),
             [{"role": "user", "content": "Tell me a story about a lighthouse."}],
             image_message("What colour dominates?", random_image(4, 320, 240))]

    def tokens(server, messages, max_tokens):
        status, body = server.chat({"model": server.model, "messages": messages, "max_tokens": max_tokens,
                                    "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    for server in (flex_server, llava_server):  # concurrent: decodes of several lengths share steps
        with ThreadPoolExecutor(len(cases)) as pool:
            server.answers = list(pool.map(lambda case: tokens(server, case[1], 12 + 4 * case[0]), enumerate(cases)))
    assert flex_server.answers == llava_server.answers
    assert all(flex_server.answers)
