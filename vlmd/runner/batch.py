"""Turning one SchedulerOutput into the step's tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vlmd.layers.attention import AttentionBackend, AttentionMetadata, OutputRows, SequenceChunk
from vlmd.runner.request_state import RunnerRequestState


@dataclass
class ScheduledSlice:
    state: RunnerRequestState
    start: int  # first position computed this step
    count: int
    row: int  # first row in the flattened batch

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def samples(self) -> bool:
        return self.end == len(self.state.token_ids)


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    slices: list[ScheduledSlice]
    sample_rows: list[int]
    sample_states: list[RunnerRequestState]
    # The sampled rows, for a decoder to run its last layer on them alone (None: all rows).
    outputs: OutputRows | None = None


# A model's positions for tokens [start, end) of a request, from its family state:
# ``slice_positions(family_state, start, end, num_prompt_tokens)`` -> [rows, end - start]
# int64, or None for plain positions (MultimodalModel.slice_positions).
SlicePositions = Callable[[Any, int, int, int], "torch.Tensor | None"]
# A model's bidirectional spans of a request, from its items: ``attention_spans(items)`` ->
# [(first, end), ...] positions whose tokens attend to each other both ways
# (MultimodalModel.attention_spans: images whose tokens see each other).
AttentionSpans = Callable[[list[Any]], "list[tuple[int, int]]"]


def build_batch(scheduled: list[tuple[RunnerRequestState, int]], attention: AttentionBackend,
                slice_positions: SlicePositions | None = None,
                attention_spans: AttentionSpans | None = None) -> StepBatch:
    """Decodes (one new token after some context) first, then prefill chunks; the
    attention backend turns the same order into its metadata, once for every layer.
    ``slice_positions``: the model's, where its positions are not plain ones;
    ``attention_spans``: the model's, where its items attend bidirectionally."""
    decodes = []
    prefills = []
    for entry in scheduled:
        (decodes if entry[1] == 1 and entry[0].num_computed_tokens > 0 else prefills).append(entry)

    input_ids: list[int] = []
    positions: list[int] = []
    slices: list[ScheduledSlice] = []
    chunks: list[SequenceChunk] = []
    row = 0
    for state, _ in decodes:  # one token each
        start = state.num_computed_tokens
        input_ids.append(state.token_ids[start])
        positions.append(start)
        slices.append(ScheduledSlice(state, start, 1, row))
        spans = _chunk_spans(state, start, 1, attention_spans)
        chunks.append(SequenceChunk.of(state.block_tables, start, 1, spans))
        row += 1
    for state, count in prefills:
        start = state.num_computed_tokens
        input_ids.extend(state.token_ids[start : start + count])
        positions.extend(range(start, start + count))
        slices.append(ScheduledSlice(state, start, count, row))
        spans = _chunk_spans(state, start, count, attention_spans)
        chunks.append(SequenceChunk.of(state.block_tables, start, count, spans))
        row += count
    meta = attention.prepare_metadata(chunks, num_decodes=len(decodes))
    sampled = [(piece, chunk) for piece, chunk in zip(slices, chunks) if piece.samples]
    used = [(piece.row + piece.count - 1, chunk) for piece, chunk in sampled]
    position_tensor = None
    if slice_positions is not None:
        position_tensor = _model_positions(slices, slice_positions)
    if position_tensor is None:
        position_tensor = torch.tensor(positions, dtype=torch.long)
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=position_tensor,
        meta=meta,
        slices=slices,
        sample_rows=[row for row, _ in used],
        sample_states=[piece.state for piece, _ in sampled],
        outputs=attention.prepare_output_rows(used, row),
    )


def _chunk_spans(state: RunnerRequestState, start: int, count: int,
                 attention_spans: AttentionSpans | None) -> tuple[tuple[int, int], ...]:
    """The bidirectional spans this chunk's queries reach (none past the prompt)."""
    if attention_spans is None or not state.mm_items or start >= state.num_prompt_tokens:
        return ()
    end = start + count
    return tuple(span for span in attention_spans(state.mm_items) if span[0] < end and span[1] > start)


def _model_positions(slices: list[ScheduledSlice], slice_positions: SlicePositions) -> torch.Tensor | None:
    """[rows, T]: each slice's positions as the model gives them, plain ones (the same in
    every row) for a slice it gives none; None where it gives none for any slice."""
    parts = [_decode_positions(piece.state, piece.start, slice_positions)
             if piece.count == 1 and piece.start >= piece.state.num_prompt_tokens
             else slice_positions(piece.state.family_state, piece.start, piece.end, piece.state.num_prompt_tokens)
             for piece in slices]
    given = [part for part in parts if part is not None]
    if not given:
        return None
    rows = given[0].shape[0]
    return torch.cat([part if part is not None else torch.arange(piece.start, piece.end).expand(rows, -1)
                      for piece, part in zip(slices, parts)], dim=1)


# Decodes past the prompt take their positions from a run the family gave ahead of time:
# a request's positions depend only on its family state and the token indices
# (``SlicePositions``), so one call covers this many steps.
POSITIONS_AHEAD = 64


def _decode_positions(state: RunnerRequestState, start: int, slice_positions: SlicePositions) -> torch.Tensor | None:
    """[rows, 1] positions of the token at ``start`` (past the prompt), or None for a plain one."""
    ahead = state.positions_ahead
    if ahead is None or not ahead[0] <= start < ahead[0] + POSITIONS_AHEAD:
        table = slice_positions(state.family_state, start, start + POSITIONS_AHEAD, state.num_prompt_tokens)
        ahead = state.positions_ahead = (start, table)
    first, table = ahead
    return None if table is None else table[:, start - first : start - first + 1]
