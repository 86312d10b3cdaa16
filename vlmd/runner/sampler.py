"""Picking the next token per row: greedy in one argmax, sampled rows one by one."""

from __future__ import annotations

import torch

from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import SamplingParams, TokenLogprob


def sample(
    logits: torch.Tensor, states: list[RunnerRequestState], default_generator: torch.Generator
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row of ``logits`` ([N, vocab], float32)."""
    # Log-probs describe the model's own distribution, before any sampling transform.
    want_logprobs = any(state.sampling.logprobs is not None for state in states)
    logprobs_table = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    for row, state in enumerate(states):
        if state.masks_stop_tokens:
            logits[row, list(state.stop_token_ids)] = float("-inf")

    tokens = logits.argmax(dim=-1).tolist()
    for row, state in enumerate(states):
        if not state.sampling.is_greedy:
            generator = state.generator_for_next_token() or default_generator
            tokens[row] = _sample_row(logits[row], state.sampling, generator)

    logprobs: list[TokenLogprob | None] = [None] * len(states)
    if logprobs_table is not None:
        for row, state in enumerate(states):
            count = state.sampling.logprobs
            if count is None:
                continue
            row_logprobs = logprobs_table[row]
            top: list[tuple[int, float]] = []
            if count:
                values, indices = row_logprobs.topk(count)
                top = list(zip(indices.tolist(), values.tolist()))
            logprobs[row] = TokenLogprob(tokens[row], float(row_logprobs[tokens[row]]), top)
    return tokens, logprobs


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    scaled = row / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        threshold = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = probs.cumsum(dim=-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
