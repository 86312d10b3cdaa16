"""Turning one SchedulerOutput into the step's tensors."""

from __future__ import annotations

from dataclasses import dataclass

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


def build_batch(scheduled: list[tuple[RunnerRequestState, int]], attention: AttentionBackend) -> StepBatch:
    """Decodes (one new token after some context) first, then prefill chunks; the
    attention backend turns the same order into its metadata, once for every layer."""
    decodes = [(s, n) for s, n in scheduled if n == 1 and s.num_computed_tokens > 0]
    prefills = [(s, n) for s, n in scheduled if not (n == 1 and s.num_computed_tokens > 0)]

    input_ids: list[int] = []
    positions: list[int] = []
    slices: list[ScheduledSlice] = []
    chunks: list[SequenceChunk] = []
    row = 0
    for state, count in decodes + prefills:
        start = state.num_computed_tokens
        input_ids.extend(state.token_ids[start : start + count])
        positions.extend(range(start, start + count))
        slices.append(ScheduledSlice(state, start, count, row))
        chunks.append(SequenceChunk(state.block_ids, start, count))
        row += count
    meta = attention.prepare_metadata(chunks, num_decodes=len(decodes))
    sampled = [(piece, chunk) for piece, chunk in zip(slices, chunks) if piece.samples]
    used = [(piece.row + piece.count - 1, chunk) for piece, chunk in sampled]
    if any(piece.state.mrope_positions is not None for piece in slices):
        position_tensor = torch.cat([mrope_positions(piece) for piece in slices], dim=1)
    else:
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


def mrope_positions(piece: ScheduledSlice) -> torch.Tensor:
    """[3, count] M-RoPE positions: precomputed for the prompt, index + delta after it.

    A request without M-RoPE data (text only) uses (p, p, p), which is plain RoPE.
    """
    state = piece.state
    table = state.mrope_positions
    prompt_end = min(piece.end, state.num_prompt_tokens) if table is not None else piece.start
    parts = []
    if piece.start < prompt_end:
        parts.append(torch.as_tensor(table[:, piece.start : prompt_end], dtype=torch.long))
    first_generated = max(piece.start, prompt_end)
    if first_generated < piece.end:
        delta = state.mrope_position_delta if table is not None else 0
        parts.append(torch.arange(first_generated, piece.end).add_(delta).expand(3, -1))
    return torch.cat(parts, dim=1)
