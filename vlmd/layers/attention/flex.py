"""The CUDA attention backend on torch's own kernels: FlexAttention over the paged cache.

The default on CUDA (``--attention-kernels auto``, or ``flex`` on any device: on the CPU it
is the parity tests' way to run this same code). Nothing but CUDA torch is needed: the
paged reads are FlexAttention's block-sparse kernel (Triton, compiled by
``torch.compile`` on first use of a shape), prefill chunks without cached context are
SDPA's (its flash path on CUDA). docs/decisions.md D96 says why and what is unmeasured.

How a step maps onto FlexAttention, for each group of sequences (the decodes; the prefill
chunks that have cached context):

- The cache ``[slots, Hkv, D]`` is the keys and values of one batch row, broadcast over the
  group's sequences (``[1, Hkv, slots, D]``, a view: no copy); queries are ``[B, H, n, D]``
  (one row per sequence, ``n`` = 1 for decodes, the longest chunk for prefill, padded).
- The **block mask** is built from the block tables: its KV block is the cache's block,
  and each (sequence, tile of 128 query rows) lists the *physical* blocks it reads, full
  ones (attended without a mask) apart from partial ones (causal edge, window edge,
  bidirectional spans). A block no query of the tile may see is not listed and never read.
- The **mask_mod** is exact on its own: a per-step lookup ``[B, cache blocks]`` from
  physical block to its index in the sequence's table (-1: not in it) gives each key's
  position, then causal, same-span and window rules apply as transformers states them
  (``masked.visibility``). On the CPU torch runs FlexAttention eagerly, which ignores the
  block lists and applies the mask_mod to every key (there the cache is cut at the
  highest block the step uses); the CPU tests check the lists separately
  (``block_mask_agrees``), so both halves of what CUDA runs are tested here.

Decode steps of a decoder described as data (``DecoderStructure``) run under CUDA graphs
on CUDA: one graph per bucket of batch sizes (``graph_buckets.py``), captured on the first
step of that size, padded rows copying the first decode. The capture runs only on CUDA;
on the CPU ``run_decode_step`` returns None and the model's modules run
(``structure_decode_step`` is the graphs' body, tested on the CPU against the modules).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from vlmd.config import ATTENTION_KERNEL_MODES
from vlmd.layers.activation import gated_activation
from vlmd.layers.attention.backend import (
    MAIN_GROUP,
    AttentionBackend,
    AttentionMetadata,
    SequenceChunk,
    layer_group,
    write_kv,
)
from vlmd.layers.attention.graph_buckets import bucket_for, graph_buckets
from vlmd.layers.attention.masked import check_spans, visibility
from vlmd.layers.rotary import rotate_qkv

# Query rows per tile of the block mask (FlexAttention's default sparse block).
QUERY_TILE = 128
# The largest decode batch captured as a CUDA graph; a larger step runs without one. Each
# bucket is a compile of FlexAttention for its shape (torch.compile's default limit is 8
# per function: the buckets up to 32 are 7) and static mask buffers of 12 bytes per row
# and cache block.
MAX_GRAPH_BATCH = 32


def sequence_table(chunk: SequenceChunk) -> list[int]:
    """The block table a layer reads for ``chunk``: its KV group's (the metadata is the
    layer's group's, ``AttentionMetadata.for_group``); the one place this module reads a
    chunk's tables."""
    return chunk.block_ids


def flex_kernel_options(block_size: int, device: torch.device) -> dict | None:
    """The Triton kernel's KV tile must divide the mask's KV block (the cache block): at
    most 64 keys (its default), at least 16 (the matrix instructions' width)."""
    if device.type != "cuda":
        return None
    if block_size % 16:
        raise ValueError(f"the flex backend on CUDA needs a block size that is a multiple of 16, got {block_size}")
    tile = 64
    while block_size % tile:
        tile //= 2
    return {"BLOCK_N": tile}


@dataclass
class FlexGroup:
    """Sequences attended in one FlexAttention call: queries ``[B, H, n, D]``."""

    rows: list[tuple[int, int]]  # [first, end) rows of the flattened batch, per sequence
    query_length: int  # n: the longest sequence's rows (1 for decodes)
    block_mask: BlockMask
    cache_tokens: int  # keys given to the call: the cache cut at the highest block used, or whole
    # What the mask_mod reads: (physical -> logical block [B, blocks], query start [B],
    # each query's span first and end [B, n]); a graph's are refilled before each replay.
    mask_inputs: tuple[torch.Tensor, ...]
    static: bool = False  # the whole cache, lists as wide as it: shapes that never change (graphs)


@dataclass
class FlexPlan:
    """One step's reads for the layers of one table (full attention, or one window)."""

    slots: torch.Tensor  # [T] where each new token's K/V is written
    decodes: FlexGroup | None
    prefills: FlexGroup | None  # chunks with cached context
    # Chunks without cached context, through SDPA: (rows, [n, n] bool mask or None = causal).
    fresh: list[tuple[tuple[int, int], torch.Tensor | None]] = field(default_factory=list)


@dataclass
class FlexMetadata(AttentionMetadata):
    _plans: dict = field(default_factory=dict)  # (window, device, cache blocks) -> FlexPlan

    def plan(self, window: int | None, cache_blocks: int, device: torch.device) -> FlexPlan:
        """The reads of layers of ``window`` over a cache of ``cache_blocks`` blocks: built on
        first use, then shared by those layers."""
        key = (window, device, cache_blocks)
        if key not in self._plans:
            self._plans[key] = plan_step(self.chunks, self.num_decodes, window, self.backend.block_size,
                                         cache_blocks, device)
        return self._plans[key]


def sequence_slots(table: list[int], start: int, count: int, block_size: int) -> list[int]:
    return [table[position // block_size] * block_size + position % block_size
            for position in range(start, start + count)]


def plan_step(chunks: list[SequenceChunk], num_decodes: int, window: int | None, block_size: int,
              cache_blocks: int, device: torch.device) -> FlexPlan:
    slots: list[int] = []
    decodes: list[tuple[tuple[int, int], SequenceChunk]] = []
    prefills: list[tuple[tuple[int, int], SequenceChunk]] = []
    fresh: list[tuple[tuple[int, int], torch.Tensor | None]] = []
    row = 0
    for index, chunk in enumerate(chunks):
        rows = (row, row + chunk.count)
        slots.extend(sequence_slots(sequence_table(chunk), chunk.start, chunk.count, block_size))
        if index < num_decodes:
            decodes.append((rows, chunk))
        elif chunk.start > 0:
            prefills.append((rows, chunk))
        else:  # no cached context: its own keys are this step's k/v
            positions = torch.arange(chunk.count)
            spanned = bool(chunk.spans) or (window is not None and window < chunk.count)
            mask = visibility(positions, positions, chunk.spans, window).to(device) if spanned else None
            fresh.append((rows, mask))
        row += chunk.count
    return FlexPlan(
        slots=torch.tensor(slots, dtype=torch.long).to(device),
        decodes=flex_group(decodes, window, block_size, cache_blocks, device) if decodes else None,
        prefills=flex_group(prefills, window, block_size, cache_blocks, device) if prefills else None,
        fresh=fresh,
    )


@dataclass
class TileBlocks:
    """One sequence's block lists, per query tile: logical block indices."""

    full: list[list[int]]
    partial: list[list[int]]


def tile_blocks(start: int, count: int, spans: tuple[tuple[int, int], ...], window: int | None,
                block_size: int, query_tile: int = QUERY_TILE) -> TileBlocks:
    """Which logical blocks each tile of a sequence's queries reads: ``full`` where every
    query may see every key of the block, ``partial`` where some may (the mask_mod decides
    each pair). Over-listing a partial block costs time, never correctness; a full block
    must be exact. Torch-free arithmetic over positions."""
    end = start + count
    tiles = -(-count // query_tile)
    full: list[list[int]] = []
    partial: list[list[int]] = []
    for tile in range(tiles):
        first = start + tile * query_tile
        last = min(end, first + query_tile) - 1
        tile_full, tile_partial = [], []
        for block in range(-(-end // block_size)):
            key_first, key_last = block * block_size, block * block_size + block_size - 1
            # In the window of some query of the tile (each query sees keys > its position - window).
            in_band = window is None or key_last > first - window
            seen = key_first <= last and in_band
            if not seen and in_band:
                seen = any(lo <= last and hi > first and key_first < hi and key_last >= lo for lo, hi in spans)
            if not seen:
                continue
            whole = key_last <= first and (window is None or key_first > last - window)
            (tile_full if whole else tile_partial).append(block)
        full.append(tile_full)
        partial.append(tile_partial)
    return TileBlocks(full, partial)


def flex_group(members: list[tuple[tuple[int, int], SequenceChunk]], window: int | None, block_size: int,
               cache_blocks: int, device: torch.device, static: bool = False) -> FlexGroup:
    """The block mask of one group's FlexAttention call (built on the host, moved once).
    ``static``: lists and lookup as wide as the whole cache (a CUDA graph's buffers);
    else they reach the highest block the group uses, and so do the keys given."""
    count = len(members)
    query_length = max(chunk.count for _, chunk in members)
    tiles = -(-query_length // QUERY_TILE)
    lists = []
    used_blocks = 0
    for _, chunk in members:
        table = sequence_table(chunk)
        end = chunk.start + chunk.count
        if len(table) * block_size < end:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
        blocks = tile_blocks(chunk.start, chunk.count, chunk.spans, window, block_size)
        physical = []
        for kind in (blocks.full, blocks.partial):
            tiles_of_kind = []
            for tile in kind:
                ids = [table[block] for block in tile]
                if any(block < 0 or block >= cache_blocks for block in ids):
                    raise ValueError(f"a block table read by a step names blocks {ids} outside the cache's "
                                     f"{cache_blocks} (or freed)")
                tiles_of_kind.append(ids)
                used_blocks = max([used_blocks] + [block + 1 for block in ids])
            physical.append(tiles_of_kind)
        lists.append(physical)
    # The CPU's eager FlexAttention reads every key it is given: the cache is cut at the
    # highest block used (CUDA's kernel reads only the listed blocks either way).
    extent = cache_blocks if static else max(used_blocks, 1)
    widest = cache_blocks if static else max(1, max(len(tile) for physical in lists for kind in physical
                                                     for tile in kind))
    # One tensor each, built from lists (an element at a time through torch costs ~5 us).
    num = torch.tensor([[[[len(kind[tile]) if tile < len(kind) else 0 for tile in range(tiles)]]
                         for kind in (physical[0] for physical in lists)],
                        [[[len(kind[tile]) if tile < len(kind) else 0 for tile in range(tiles)]]
                         for kind in (physical[1] for physical in lists)]], dtype=torch.int32)
    padded = [[[[ids + [0] * (widest - len(ids)) for ids in kind] + [[0] * widest] * (tiles - len(kind))]
               for kind in (physical[which] for physical in lists)] for which in (0, 1)]
    indices = torch.tensor(padded, dtype=torch.int32)
    # The lookup physical block -> index in the table, scattered where it is used (on CUDA
    # a [B, blocks] fill on the device, not a copy of it).
    rows, columns, values = [], [], []
    span_first = [[0] * query_length for _ in members]
    span_end = [[0] * query_length for _ in members]
    for member, (_, chunk) in enumerate(members):
        table = sequence_table(chunk)
        for block in range(-(-(chunk.start + chunk.count) // block_size)):
            if 0 <= table[block] < extent:
                rows.append(member)
                columns.append(table[block])
                values.append(block)
        for lo, hi in chunk.spans:  # each query's own span: keys in it are visible both ways
            for position in range(max(lo, chunk.start), min(hi, chunk.start + chunk.count)):
                span_first[member][position - chunk.start] = lo
                span_end[member][position - chunk.start] = hi
    logical = torch.full((count, extent), -1, dtype=torch.int32, device=device)
    where = (torch.tensor(rows, dtype=torch.long).to(device), torch.tensor(columns, dtype=torch.long).to(device))
    logical[where] = torch.tensor(values, dtype=torch.int32).to(device)
    query_start = torch.tensor([chunk.start for _, chunk in members], dtype=torch.int32)
    span_first, span_end = torch.tensor(span_first, dtype=torch.int32), torch.tensor(span_end, dtype=torch.int32)
    num, indices, query_start, span_first, span_end = (
        tensor.to(device) for tensor in (num, indices, query_start, span_first, span_end))
    mask_mod = paged_mask(logical, query_start, span_first, span_end, block_size, window)
    block_mask = BlockMask.from_kv_blocks(
        num[1], indices[1], num[0], indices[0], BLOCK_SIZE=(QUERY_TILE, block_size), mask_mod=mask_mod,
        seq_lengths=(query_length, extent * block_size), compute_q_blocks=False)
    return FlexGroup([rows for rows, _ in members], query_length, block_mask, extent * block_size,
                     (logical, query_start, span_first, span_end), static)


def paged_mask(logical: torch.Tensor, query_start: torch.Tensor, span_first: torch.Tensor,
               span_end: torch.Tensor, block_size: int, window: int | None) -> Callable:
    """The mask_mod of a group: may query ``q`` of sequence ``b`` see cache slot ``kv``?"""

    def mask_mod(b, h, q, kv):
        block = logical[b, kv // block_size]
        key = block * block_size + kv % block_size
        query = query_start[b] + q
        allowed = (key <= query) | ((span_first[b, q] <= key) & (key < span_end[b, q]))
        if window is not None:
            allowed = allowed & (key > query - window)
        return allowed & (block >= 0)

    return mask_mod


def _flex_static(query, key, value, block_mask, scale, enable_gqa, kernel_options):
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


def _flex_dynamic(query, key, value, block_mask, scale, enable_gqa, kernel_options):
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


_COMPILED: dict[bool, Callable] = {}


def run_flex(query, key, value, block_mask: BlockMask, scale: float, kernel_options: dict | None,
             static: bool = False) -> torch.Tensor:
    """FlexAttention, compiled on CUDA (its Triton kernel), eager elsewhere (the CPU tests).
    Two compiled functions, each with its own recompile budget: graphs' fixed shapes
    (one compile per bucket, and the decoding kernel, which needs a static batch), and
    every other step's, compiled once for any shape."""
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cuda":
        if static not in _COMPILED:
            _COMPILED[static] = torch.compile(_flex_static if static else _flex_dynamic, dynamic=not static)
        return _COMPILED[static](query, key, value, block_mask, scale, gqa, kernel_options)
    with warnings.catch_warnings():  # eager on purpose: the unfused path is the CPU's reference
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


class FlexBackend(AttentionBackend):
    name = "flex"

    def __init__(self, block_size: int, kernels: str = "flex", graphs: bool = True):
        """``graphs``: decode steps under CUDA graphs where the device is CUDA."""
        super().__init__(block_size)
        if kernels not in ATTENTION_KERNEL_MODES:
            raise ValueError(f"attention kernels {kernels!r} is not one of {', '.join(ATTENTION_KERNEL_MODES)}")
        self.graphs = DecodeGraphs(graph_buckets(MAX_GRAPH_BATCH)) if graphs else None

    def prepare_metadata(self, chunks: list[SequenceChunk], num_decodes: int) -> FlexMetadata:
        for index, chunk in enumerate(chunks):
            if index < num_decodes and (chunk.count != 1 or chunk.start == 0):
                raise ValueError("a decode is one new token after some context")
            check_spans(chunk)
        slots = [slot for chunk in chunks
                 for slot in sequence_slots(checked_table(chunk, self.block_size), chunk.start, chunk.count,
                                            self.block_size)]
        return FlexMetadata(backend=self, slot_mapping=torch.tensor(slots, dtype=torch.long),
                            num_decodes=num_decodes, chunks=list(chunks),
                            group=chunks[0].group if chunks else MAIN_GROUP)

    def forward(self, q, k, v, kv_cache, meta: FlexMetadata, scale: float, window: int | None = None,
                write: bool = True) -> torch.Tensor:
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be >= 1 token, got {window}")
        k_cache, v_cache = kv_cache
        meta = meta.for_group(layer_group(kv_cache, meta))
        cache_blocks = k_cache.shape[0] // self.block_size
        plan = meta.plan(window, cache_blocks, q.device)
        if write:
            write_kv(kv_cache, k, v, meta.slot_mapping if window is None else plan.slots)
        out = torch.empty_like(q)
        options = flex_kernel_options(self.block_size, q.device)
        heads, kv_heads = q.shape[1], k.shape[1]
        for group in (plan.decodes, plan.prefills):
            if group is None:
                continue
            keys = k_cache[: group.cache_tokens].permute(1, 0, 2).unsqueeze(0)
            values = v_cache[: group.cache_tokens].permute(1, 0, 2).unsqueeze(0)
            if group.query_length == 1:  # decodes: [B, H, 1, D] straight from their rows
                first, end = group.rows[0][0], group.rows[-1][1]
                queries = q[first:end].unsqueeze(2)
                attended = run_flex(queries, keys, values, group.block_mask, scale, options, group.static)
                out[first:end] = attended[:, :, 0]
                continue
            queries = q.new_zeros(len(group.rows), heads, group.query_length, q.shape[2])
            for member, (first, end) in enumerate(group.rows):
                queries[member, :, : end - first] = q[first:end].transpose(0, 1)
            attended = run_flex(queries, keys, values, group.block_mask, scale, options)
            for member, (first, end) in enumerate(group.rows):
                out[first:end] = attended[member, :, : end - first].transpose(0, 1)
        for (first, end), mask in plan.fresh:
            attended = F.scaled_dot_product_attention(
                q[first:end].transpose(0, 1).unsqueeze(0), k[first:end].transpose(0, 1).unsqueeze(0),
                v[first:end].transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=heads != kv_heads)
            out[first:end] = attended[0].transpose(0, 1)
        return out

    def run_decode_step(self, structure, embeds, cos, sin, meta: FlexMetadata, kv_caches) -> torch.Tensor | None:
        """A step of decodes as a CUDA graph of ``structure_decode_step`` (CUDA only: None
        elsewhere, and for what the graphs do not capture, so the modules run)."""
        if self.graphs is None or embeds.device.type != "cuda":
            return None
        if any(layer_group(cache, meta) != meta.group for cache in kv_caches):
            return None  # the graph reads the main group's tables for every layer
        return self.graphs.run(self, structure, embeds, cos, sin, meta, kv_caches)


def checked_table(chunk: SequenceChunk, block_size: int) -> list[int]:
    table = sequence_table(chunk)
    if len(table) * block_size < chunk.start + chunk.count:
        raise ValueError(f"block table of {len(table)} blocks cannot hold {chunk.start + chunk.count} tokens")
    return table


def structure_decode_step(backend: AttentionBackend, structure, embeds: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
    """Every layer of a ``DecoderStructure`` in torch ops through its modules (what
    ``LlamaForCausalLM.forward`` runs, as one function a CUDA graph can capture): the final
    norm's output. ``cos``/``sin``: [rows, head_dim]."""
    heads, kv_heads, head_dim = structure.heads, structure.kv_heads, structure.head_dim
    rows = embeds.shape[0]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    hidden, residual = embeds, None
    for layer, kv_cache in zip(structure.layers, kv_caches):
        if residual is None:
            residual, normed = hidden.clone(), layer.input_norm(hidden)
        else:
            normed, residual = layer.input_norm.add_forward(residual, hidden)
        qkv = layer.qkv(normed)
        if structure.query_key_norm:
            layer.query_norm.heads_(qkv, 0, heads)
            layer.key_norm.heads_(qkv, heads * head_dim, kv_heads)
        q, k, v = rotate_qkv(qkv, heads, kv_heads, head_dim, cos, sin)
        attended = backend.forward(q, k, v, kv_cache, meta, structure.scale)
        normed, residual = layer.post_norm.add_forward(residual, layer.o(attended.reshape(rows, heads * head_dim)))
        hidden = layer.down(gated_activation(layer.gate_up(normed), structure.intermediate, structure.activation))
    return structure.final_norm.add_forward(residual, hidden)[0]


@dataclass
class CapturedStep:
    graph: object  # torch.cuda.CUDAGraph
    embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    meta: FlexMetadata  # its plan's tensors are the graph's inputs, refilled before each replay
    output: torch.Tensor


class DecodeGraphs:
    """Decode steps as CUDA graphs, one per (decoder, bucket), captured on first use.

    A step of ``B`` decodes runs as the smallest bucket ``P >= B``: rows ``B..P`` repeat
    the first decode (its inputs, its table, its slot), so they write the same K/V to the
    same slot and their outputs are dropped. The graph reads static buffers: the inputs,
    the slots, and a block mask as wide as the whole cache; before each replay the step's
    own (narrower) plan is copied into their leading part. A lookup entry left from an
    earlier step is never read: the kernel evaluates the mask only on the blocks the
    step's lists name, whose entries the step rewrote. Decoders with sliding windows or
    tensor parallelism (collectives inside a capture) or any other of the structure's
    ``additions()`` (Gemma 3's layer) are not captured. CUDA only; not
    yet run on a GPU (docs/decisions.md D96)."""

    def __init__(self, buckets: tuple[int, ...]):
        self.buckets = buckets
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        self.failed: str | None = None  # why capturing was given up (the modules run then)

    def run(self, backend: FlexBackend, structure, embeds, cos, sin, meta: FlexMetadata, kv_caches):
        if self.failed or structure.additions() or structure.tensor_parallel != 1:
            return None
        rows = embeds.shape[0]
        bucket = bucket_for(rows, self.buckets)
        if bucket is None:
            return None
        device = embeds.device
        cache_blocks = kv_caches[0][0].shape[0] // backend.block_size
        padded = meta.chunks[:rows] + [meta.chunks[0]] * (bucket - rows)
        members = [((row, row + 1), chunk) for row, chunk in enumerate(padded)]
        step = flex_group(members, None, backend.block_size, cache_blocks, device)
        slots = meta.slot_mapping[:rows]
        key = (id(structure), bucket)
        captured = self.captured.get(key)
        if captured is None:
            static = flex_group(members, None, backend.block_size, cache_blocks, device, static=True)
            static_meta = FlexMetadata(backend=backend, slot_mapping=slots.new_empty(bucket), num_decodes=bucket,
                                       chunks=padded)
            fill(static_meta.slot_mapping, slots, rows)
            static_meta._plans[(None, device, cache_blocks)] = FlexPlan(static_meta.slot_mapping, static, None)
            try:
                captured = self.capture(backend, structure, embeds, cos, sin, static_meta, kv_caches, bucket)
            except RuntimeError as error:  # a capture CUDA refuses: the modules run from now on
                self.failed = f"{type(error).__name__}: {error}"
                return None
            self.captured[key] = captured
        fill(captured.embeds, embeds, rows)
        fill(captured.cos, cos, rows)
        fill(captured.sin, sin, rows)
        fill(captured.meta.slot_mapping, slots, rows)
        copy_group(captured.meta._plans[(None, device, cache_blocks)].decodes, step)
        captured.graph.replay()
        return captured.output[:rows].clone()

    def capture(self, backend, structure, embeds, cos, sin, static_meta: FlexMetadata, kv_caches, bucket: int):
        rows = embeds.shape[0]
        static_embeds = embeds.new_empty(bucket, embeds.shape[1])
        static_cos, static_sin = cos.new_empty(bucket, cos.shape[1]), sin.new_empty(bucket, sin.shape[1])
        fill(static_embeds, embeds, rows)
        fill(static_cos, cos, rows)
        fill(static_sin, sin, rows)
        # The first call compiles FlexAttention for this shape and writes the step's K/V
        # (the same values the replay writes again), outside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            structure_decode_step(backend, structure, static_embeds, static_cos, static_sin, static_meta, kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            output = structure_decode_step(backend, structure, static_embeds, static_cos, static_sin, static_meta,
                                           kv_caches)
        return CapturedStep(graph, static_embeds, static_cos, static_sin, static_meta, output)


def fill(static: torch.Tensor, values: torch.Tensor, rows: int) -> None:
    """Rows ``0..rows`` of a graph input from ``values``, the padding rows from its first."""
    static[:rows].copy_(values[:rows])
    if static.shape[0] > rows:
        static[rows:].copy_(values[:1].expand(static.shape[0] - rows, *values.shape[1:]))


def copy_group(static: FlexGroup, step: FlexGroup) -> None:
    """A step's decode group (same batch, narrower lists and lookup) into a graph's buffers."""
    mask, source = static.block_mask, step.block_mask
    for target, values in ((mask.kv_num_blocks, source.kv_num_blocks),
                           (mask.full_kv_num_blocks, source.full_kv_num_blocks),
                           (mask.kv_indices, source.kv_indices), (mask.full_kv_indices, source.full_kv_indices),
                           *zip(static.mask_inputs, step.mask_inputs)):
        target[tuple(slice(0, size) for size in values.shape)].copy_(values)
