"""The attention backend interface: metadata built once per step, one call per layer.

A step's tokens are one flattened batch: decodes first (one query token each), then
prefill chunks. The runner describes each scheduled sequence as a ``SequenceChunk`` and
asks the step's backend for metadata once (``prepare_metadata``); every layer then calls
``forward`` with that metadata and its own KV cache. What the metadata holds (slot indices,
segments of the block table, masks) is the backend's business: the model code never looks
inside it, it only passes it along (``vlmd.layers.attention.paged_attention``).

A layer's KV cache is a pair of tensors ``[num_blocks * block_size, kv_heads, head_dim]``;
slot = block_id * block_size + offset. Each layer belongs to a KV group (``vlmd/sched/kv_spec.py``:
full attention, a sliding window, ...) whose block tables address its tensors
(``runner/kv_cache.LayerCache.group``): ``forward`` reads the step's metadata for that group
(``AttentionMetadata.for_group``), built once per step and group, shared by its layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from vlmd.sched.cross_kv import is_consecutive

if TYPE_CHECKING:
    from vlmd.layers.decoder_structure import DecoderStructure


# The group every step's metadata is built for first: full attention's, the decoder's main
# table (kv_spec.build_kv_cache_config lists full-attention groups first).
MAIN_GROUP = 0


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step: ``count`` new tokens at positions ``start..``."""

    block_ids: list[int]  # the sequence's table in ``group`` (it covers at least start + count)
    start: int  # tokens already in the cache (its context)
    count: int
    # Bidirectional spans: [first, end) positions whose tokens attend to each other in both
    # directions (an image's tokens in some VLMs), the rest causally. A span that reaches this
    # chunk's queries must end inside it: its later keys are not in the cache otherwise.
    spans: tuple[tuple[int, int], ...] = ()
    # KV group -> the sequence's table there, where the model has more than one group (a
    # window group's entries before its window are FREED and never read); None: one group.
    tables: Mapping[int, list[int]] | None = None
    group: int = MAIN_GROUP  # whose table ``block_ids`` is

    @classmethod
    def of(cls, tables: Mapping[int, list[int]], start: int, count: int,
           spans: tuple[tuple[int, int], ...] = ()) -> "SequenceChunk":
        """A chunk from a request's tables by group, described in the main group."""
        return cls(tables[MAIN_GROUP], start, count, spans, tables if len(tables) > 1 else None)

    def for_group(self, group: int) -> "SequenceChunk":
        """The same chunk described in ``group``'s table."""
        if group == self.group:
            return self
        if self.tables is None or group not in self.tables:
            raise ValueError(f"a sequence without a table in KV group {group}")
        return replace(self, block_ids=self.tables[group], group=group)


@dataclass
class AttentionMetadata:
    """What every backend's metadata has; backends subclass it with their own fields."""

    backend: "AttentionBackend"
    slot_mapping: torch.Tensor  # [T] the cache slot each new token's K/V is written to
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    chunks: list[SequenceChunk]  # in batch order, described in ``group``'s tables
    group: int = field(default=MAIN_GROUP, kw_only=True)
    # Other groups' metadata, built on first use.
    _groups: dict = field(default_factory=dict, repr=False, kw_only=True)
    # Recurrent states the step's linear-attention layers computed, stored only once the
    # whole step has run (``linear_attention.state.commit_states``): a step re-run after a
    # failure starts again from the states before it.
    pending_states: list = field(default_factory=list, repr=False, kw_only=True)
    # This step's metadata without bidirectional spans (``causal``), built on first use.
    _causal: "AttentionMetadata | None" = field(default=None, repr=False, kw_only=True)

    def for_group(self, group: int) -> "AttentionMetadata":
        """This step's metadata for layers of KV group ``group``: itself, or built from the
        chunks' tables there on first use, then shared by that group's layers."""
        if group == self.group:
            return self
        if group not in self._groups:
            chunks = [chunk.for_group(group) for chunk in self.chunks]
            self._groups[group] = self.backend.prepare_metadata(chunks, self.num_decodes)
        return self._groups[group]

    def causal(self) -> "AttentionMetadata":
        """This step's metadata with every chunk's bidirectional spans dropped, for the layers
        of a model whose queries attend causally even inside an item (Gemma 4's full-attention
        layers, where its windowed ones see an image's tokens both ways): itself where no
        chunk has spans, else built on first use and shared by those layers."""
        if not any(chunk.spans for chunk in self.chunks):
            return self
        if self._causal is None:
            self._causal = self.backend.prepare_metadata([replace(chunk, spans=()) for chunk in self.chunks],
                                                         self.num_decodes)
        return self._causal


@dataclass(frozen=True)
class CrossSpan:
    """Rows of a step's queries that cross-attend to one sequence's encoder tokens (an
    encoder-decoder's: Whisper's audio, Llama 3.2 Vision's images), whose K/V sit in the
    sequence's table of the layer's cross-attention KV group."""

    first: int  # [first, end) rows of the queries
    end: int
    table: Sequence[int]  # the sequence's cross-attention table
    num_tokens: int  # its encoder tokens
    mask: torch.Tensor | None = None  # [end - first, num_tokens] bool, True = may attend; None: all


def cross_region(table: Sequence[int], block_size: int) -> int | None:
    """Where a cross-attention table's rows start if its blocks are one run (the manager takes
    runs first), else None. Such a table's ``num_tokens`` rows of a slot are one contiguous
    region, which holds the K (or V) heads first, ``[kv_heads, num_tokens, head_dim]``: read
    as a view each head's tokens are contiguous, as attention reads them fastest (token-major
    rows, ``[tokens, heads, dim]``, cost tiny.en's decode 10 % through strided reads). A table
    split across the pool keeps the token-major rows and is gathered."""
    return table[0] * block_size if table and is_consecutive(table) else None


def cross_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], table: Sequence[int], num_tokens: int,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's cross-attention K and V ``[kv_heads, num_tokens, head_dim]`` read through
    its table: a contiguous view of its region where the table is one run (``cross_region``),
    else gathered."""
    k_cache, v_cache = kv_cache
    if len(table) * block_size < num_tokens or not table:
        raise RuntimeError(f"a cross-attention table of {len(table)} blocks for {num_tokens} tokens")
    start = cross_region(table, block_size)
    if start is not None:
        heads, dim = k_cache.shape[1], k_cache.shape[2]
        return (k_cache[start:start + num_tokens].view(heads, num_tokens, dim),
                v_cache[start:start + num_tokens].view(heads, num_tokens, dim))
    blocks = torch.tensor(list(table), dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens].to(k_cache.device)
    return k_cache.index_select(0, slots).transpose(0, 1), v_cache.index_select(0, slots).transpose(0, 1)


class LayerCache(tuple):
    """A layer's (K, V) cache tensors, which unpack as a pair, and the KV group whose block
    tables address them (``runner/kv_cache.py`` makes them from the pool's layer slots)."""

    group: int

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, group: int) -> "LayerCache":
        pair = super().__new__(cls, (k_cache, v_cache))
        pair.group = group
        return pair


def layer_group(kv_cache, meta: AttentionMetadata) -> int:
    """The KV group of a layer's cache; a bare (K, V) pair, as kernels' tests pass, is taken
    as the metadata's own group."""
    return kv_cache.group if isinstance(kv_cache, LayerCache) else meta.group


# A prefill chunk of at most this many tokens after some context may run in a fused decode
# step as that many decodes (``AttentionBackend.short_chunks_as_decodes``): a prompt whose
# prefix was cached leaves such a chunk, and a step holding one beside decodes otherwise runs
# every layer as modules. Measured: the small Qwen2-VL at c8 with one image repeated, bfloat16
# (py-spy, AMD EPYC family 25 model 17): 25 % of the engine thread in module-path layers for
# the steps that carried such a chunk (each a prompt's last 16 tokens past its cached blocks).
FUSED_CHUNK_TOKENS = 16


@dataclass
class OutputRows:
    """The rows of a step whose final hidden states are used: the last new token of each
    sequence that samples. Every other row's output in the decoder's last layer feeds
    nothing (its K/V do: they go to the cache), so that layer runs only these rows, which
    attend as decodes do, each after its whole sequence so far (``meta``).
    """

    rows: torch.Tensor  # [R] rows of the flattened batch, in batch order
    meta: AttentionMetadata | None  # the R rows as decodes; None when R is 0


class AttentionBackend:
    """Base class: ``prepare_metadata`` once per step, ``forward`` once per layer."""

    name = "base"

    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Steps of decodes alone, by the path they took: "fused" (one call through every
        # layer, ``run_decode_step``) or "modules" (the model's layers one by one); and
        # "fused_chunks": steps with short prefill chunks that ran fused as decodes (below).
        self.decode_steps = {"fused": 0, "modules": 0, "fused_chunks": 0}

    def prepare_metadata(self, chunks: list[SequenceChunk], num_decodes: int) -> AttentionMetadata:
        """``chunks`` in batch order; the first ``num_decodes`` are decodes (count 1, start > 0)."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D] this step's keys, written to the cache first
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        write: bool = True,
    ) -> torch.Tensor:  # [T, H, D]
        """``window``: a sliding-window layer's reach, each query attending to keys at
        positions ``> position - window`` only (None: the whole context). ``write=False``:
        ``k``/``v`` are already in the cache at the step's slots (``forward_shared``)."""
        raise NotImplementedError

    def forward_shared(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                       scale: float, window: int | None = None) -> torch.Tensor:
        """A layer that reads another layer's K/V (``SharedKV``, D111): that layer, earlier in
        this step, wrote the step's keys and values at the group's slots; attend over them and
        the cached context as ``forward`` does, writing nothing."""
        slots = meta.for_group(layer_group(kv_cache, meta)).slot_mapping.to(kv_cache[0].device)
        k, v = kv_cache[0].index_select(0, slots), kv_cache[1].index_select(0, slots)
        return self.forward(q, k, v, kv_cache, meta, scale, window, write=False)

    def decode_step(self, structure: "DecoderStructure", embeds: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, meta: AttentionMetadata, kv_caches,
                    outputs: OutputRows | None = None) -> torch.Tensor | None:
        """A step of decodes through every layer of ``structure`` (a model's decoder,
        described as data: ``layers/decoder_structure.py``) in one call, returning the final
        norm's output (``outputs``' rows alone where given, as the model returns them), or
        None: then the model runs its modules, each layer calling ``forward``. ``cos`` / ``sin``
        [rows, head_dim] are the model's rotary tables for the step's positions ([tables, rows,
        head_dim] where ``structure.rotary_tables`` > 1, each layer rotating by its ``rotary``'s).
        A step with prefill rows runs so only where ``FUSES_SHORT_CHUNKS`` and every chunk is
        short (``short_chunks_as_decodes``); else None (not counted)."""
        step_meta = meta
        if meta.num_decodes != embeds.shape[0]:
            step_meta = self.short_chunks_as_decodes(meta) if self.FUSES_SHORT_CHUNKS else None
            if step_meta is None:
                return None
        stepped = self.run_decode_step(structure, embeds, cos, sin, step_meta, kv_caches)
        if step_meta is meta:
            self.decode_steps["modules" if stepped is None else "fused"] += 1
        elif stepped is not None:
            self.decode_steps["fused_chunks"] += 1
        if stepped is not None and outputs is not None:
            stepped = stepped[outputs.rows]
        return stepped

    # Whether ``decode_step`` may run a step with short prefill chunks as decodes (a backend
    # whose fused step writes every row's K/V before any row attends, as decoder_step.c does).
    FUSES_SHORT_CHUNKS = False

    def short_chunks_as_decodes(self, meta: AttentionMetadata) -> AttentionMetadata | None:
        """The step's metadata with each prefill chunk's rows as decodes, or None where a
        chunk is longer than ``FUSED_CHUNK_TOKENS``, starts a sequence, or has bidirectional
        spans. Row i of a chunk at ``start`` is then a decode at ``start + i``: it attends to
        its sequence's keys up to itself, which is causal attention as long as every row's
        K/V is in the cache before any row attends (the fused step writes them first)."""
        prefills = meta.chunks[meta.num_decodes:]
        if not prefills or any(chunk.count > FUSED_CHUNK_TOKENS or chunk.start == 0 or chunk.spans
                               for chunk in prefills):
            return None
        rows = [replace(chunk, start=chunk.start + i, count=1) for chunk in prefills for i in range(chunk.count)]
        split = [*meta.chunks[:meta.num_decodes], *rows]
        return self.prepare_metadata(split, num_decodes=len(split))

    def run_decode_step(self, structure: "DecoderStructure", embeds: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, meta: AttentionMetadata, kv_caches) -> torch.Tensor | None:
        """``decode_step`` for a step of decodes alone: a backend with a fused kernel for the
        structure overrides this; this base has none."""
        return None

    def cross_forward(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float,
                      spans: Sequence[CrossSpan]) -> torch.Tensor:
        """Cross-attention of ``q`` [R, H, D]: each span's rows attend to its sequence's
        encoder tokens (every one, or those its mask allows), read in place through its
        table; rows no span covers come back zero. One call per span: the key-value heads'
        ``G`` query heads go in as one longer run against that head's K/V, which are never
        copied (a request's encoder K/V are megabytes a layer)."""
        heads, dim = q.shape[1], q.shape[2]
        out = torch.zeros_like(q)
        for span in spans:
            k, v = cross_kv(kv_cache, span.table, span.num_tokens, self.block_size)
            kv_heads, rows = k.shape[0], span.end - span.first
            groups = heads // kv_heads
            queries = q[span.first:span.end].view(rows, kv_heads, groups, dim).permute(1, 2, 0, 3)
            queries = queries.reshape(1, kv_heads, groups * rows, dim)
            mask = None
            if span.mask is not None:
                mask = (span.mask.repeat(groups, 1) if groups > 1 else span.mask)[None, None]
            attended = F.scaled_dot_product_attention(queries, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                                      scale=scale)
            out[span.first:span.end] = attended.view(kv_heads, groups, rows, dim).permute(2, 0, 1, 3) \
                .reshape(rows, heads, dim)
        return out

    def prepare_output_rows(self, used: list[tuple[int, SequenceChunk]], num_rows: int) -> OutputRows | None:
        """``used``: (row, its chunk) for each row whose output is used, the row being its
        chunk's last token, in batch order; ``num_rows``: the step's rows. None where the
        last layer would skip nothing (every row is used) or a used row is its sequence's
        first token (a decode has some context before it)."""
        if len(used) == num_rows or any(chunk.start + chunk.count == 1 for _, chunk in used):
            return None
        rows = torch.tensor([row for row, _ in used], dtype=torch.long)
        if not used:
            return OutputRows(rows, None)
        as_decodes = [replace(chunk, start=chunk.start + chunk.count - 1, count=1, spans=()) for _, chunk in used]
        return OutputRows(rows, self.prepare_metadata(as_decodes, num_decodes=len(as_decodes)))

    def slot_mapping(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """The cache slot of every new token, in batch order."""
        size = self.block_size
        singles: list[int] = []  # decodes, as plain ints: a tensor per token costs more
        parts: list[torch.Tensor] = []
        for chunk in chunks:
            table = chunk.block_ids
            end = chunk.start + chunk.count
            if len(table) * size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            if chunk.count == 1:
                singles.append(table[chunk.start // size] * size + chunk.start % size)
                continue
            if singles:
                parts.append(torch.tensor(singles, dtype=torch.long))
                singles = []
            positions = torch.arange(chunk.start, end)
            blocks = torch.tensor(table[: -(-end // size)], dtype=torch.long)
            parts.append(blocks[positions // size] * size + positions % size)
        if singles or not parts:
            parts.append(torch.tensor(singles, dtype=torch.long))
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def write_kv(kv_cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    k_cache, v_cache = kv_cache
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
