"""Picking the next token per row: greedy in one argmax, sampled rows one by one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import SamplingParams, TokenLogprob


def sample(
    logits: torch.Tensor,
    states: list[RunnerRequestState],
    default_generator: torch.Generator,
    process_logits: Callable[[torch.Tensor, list[RunnerRequestState]], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row of ``logits`` ([N, vocab], float32).

    ``process_logits`` is the model's own rule, if it has one (Whisper's timestamp rules);
    it runs after the per-request token constraints, as transformers runs a generation
    config's suppression before the model's processors.
    """
    # Log-probs describe the model's own distribution, before any sampling transform.
    want_logprobs = any(state.sampling.logprobs is not None for state in states)
    logprobs_table = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    apply_token_constraints(logits, states)
    if process_logits is not None:
        logits = process_logits(logits, states)

    tokens = logits.argmax(dim=-1).tolist()
    for row, state in enumerate(states):
        if not state.sampling.is_greedy:
            generator = state.generator_for_next_token(logits.device) or default_generator
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


def apply_token_constraints(logits: torch.Tensor, states: list[RunnerRequestState]) -> None:
    """Mask, in place, the tokens a request may not pick now."""
    for row, state in enumerate(states):
        params = state.sampling
        if state.masks_stop_tokens:
            logits[row, list(state.stop_token_ids)] = float("-inf")
        if params.suppress_token_ids:
            logits[row, list(params.suppress_token_ids)] = float("-inf")
        if params.begin_suppress_token_ids and state.num_output_tokens == 0:
            logits[row, list(params.begin_suppress_token_ids)] = float("-inf")
        if params.allowed_token_ids is not None:
            allowed = list(params.allowed_token_ids)
            kept = logits[row, allowed].clone()
            logits[row] = float("-inf")
            logits[row, allowed] = kept


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
