"""Turning one SchedulerOutput into the step's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmd.layers.attention import AttentionMetadata, PrefillSpan
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


def build_batch(scheduled: list[tuple[RunnerRequestState, int]], block_size: int) -> StepBatch:
    """Decodes (one new token after some context) first, then prefill chunks."""
    decodes = [(s, n) for s, n in scheduled if n == 1 and s.num_computed_tokens > 0]
    prefills = [(s, n) for s, n in scheduled if not (n == 1 and s.num_computed_tokens > 0)]

    input_ids: list[int] = []
    positions: list[int] = []
    slot_chunks: list[torch.Tensor] = []
    slices: list[ScheduledSlice] = []

    decode_slots = decode_mask = None
    if decodes:
        decode_positions = [s.num_computed_tokens for s, _ in decodes]
        for row, ((state, _), position) in enumerate(zip(decodes, decode_positions)):
            input_ids.append(state.token_ids[position])
            slices.append(ScheduledSlice(state, position, 1, row))
        positions.extend(decode_positions)
        context_lens = torch.tensor(decode_positions) + 1
        num_blocks = -(-int(context_lens.max()) // block_size)
        table = torch.tensor(
            [_padded(state.block_ids, num_blocks) for state, _ in decodes], dtype=torch.long
        )
        all_slots = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).view(len(decodes), -1)
        max_len = int(context_lens.max())
        decode_slots = all_slots[:, :max_len].contiguous()
        decode_mask = (torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)).view(
            len(decodes), 1, 1, max_len
        )
        position_tensor = torch.tensor(decode_positions)
        slot_chunks.append(decode_slots.gather(1, position_tensor.unsqueeze(1)).squeeze(1))

    spans: list[PrefillSpan] = []
    row = len(decodes)
    for state, count in prefills:
        start = state.num_computed_tokens
        end = start + count
        input_ids.extend(state.token_ids[start:end])
        positions.extend(range(start, end))
        table = torch.tensor(state.block_ids, dtype=torch.long)
        # Slots for the whole prefix: the chunk's own are the tail, the rest is its context.
        token_positions = torch.arange(0, end)
        slots = table[token_positions // block_size] * block_size + token_positions % block_size
        slot_chunks.append(slots[-count:])
        if start:
            query_positions = torch.arange(start, end).unsqueeze(1)
            mask = torch.arange(end).unsqueeze(0) <= query_positions
            spans.append(PrefillSpan(row, row + count, slots, mask))
        else:
            spans.append(PrefillSpan(row, row + count, None, None))
        slices.append(ScheduledSlice(state, start, count, row))
        row += count

    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_chunks),
        num_decodes=len(decodes),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=spans,
    )
    sampled = [piece for piece in slices if piece.samples]
    if any(piece.state.mrope_positions is not None for piece in slices):
        position_tensor = torch.cat([mrope_positions(piece) for piece in slices], dim=1)
    else:
        position_tensor = torch.tensor(positions, dtype=torch.long)
    return StepBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=position_tensor,
        meta=meta,
        slices=slices,
        sample_rows=[piece.row + piece.count - 1 for piece in sampled],
        sample_states=[piece.state for piece in sampled],
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


def _padded(block_ids: list[int], length: int) -> list[int]:
    return block_ids[:length] + [0] * (length - len(block_ids[:length]))
