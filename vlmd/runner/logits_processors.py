"""The logits processors, batched over the rows of one step (no loop over the vocabulary).

``sampler.sample`` applies them in this order; each step is named after the transformers
processor it equals on the same inputs (tests/test_sampler.py checks each one):

1. ``apply_token_constraints``: min_tokens' stop-token mask, suppress lists, allowed ids
   (``MinNewTokensLengthLogitsProcessor``, ``SuppressTokens[AtBegin]LogitsProcessor``);
2. the model's own rule, if any (Whisper's timestamp rules);
3. (structured outputs: the grammar's token mask goes here);
4. ``apply_logit_bias``: OpenAI's ``logit_bias`` (``SequenceBiasLogitsProcessor`` with
   one-token sequences);
5. ``apply_penalties``: repetition (``RepetitionPenaltyLogitsProcessor``, prompt and
   output), then OpenAI's frequency and presence penalties (output only), as vLLM does;
   greedy rows take their argmax after this step;
6. ``warp`` (sampled rows): temperature, top-k, top-p, min-p (``TemperatureLogitsWarper``,
   ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, in transformers' order)
   into the probabilities the token is drawn from.
"""

from __future__ import annotations

import torch

from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import SamplingParams


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


def apply_logit_bias(logits: torch.Tensor, states: list[RunnerRequestState]) -> None:
    """Add each request's ``logit_bias`` in place, with one scatter for the whole batch."""
    rows, ids, values = [], [], []
    for row, state in enumerate(states):
        bias = state.sampling.logit_bias
        if bias:
            rows.extend([row] * len(bias))
            ids.extend(token for token, _ in bias)
            values.extend(value for _, value in bias)
    if rows:
        index = (torch.tensor(rows), torch.tensor(ids))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[RunnerRequestState]) -> None:
    """Repetition, frequency and presence penalties in place, for the rows that have any.

    The counts come from each request's ``TokenCounts``, kept up to date token by token
    by the runner (``RunnerRequestState.append_token``), never rebuilt per step.
    """
    rows = [row for row, state in enumerate(states) if state.sampling.has_penalties]
    if not rows:
        return
    vocab_size = logits.shape[1]
    counts = [states[row].token_counts_for(vocab_size) for row in rows]
    params = [states[row].sampling for row in rows]
    scores = logits[rows]
    repetition = _column([p.repetition_penalty for p in params])
    if (repetition != 1.0).any():
        seen = torch.stack([c.seen for c in counts])
        penalized = torch.where(scores < 0, scores * repetition, scores / repetition)
        scores = torch.where(seen, penalized, scores)
    frequency = _column([p.frequency_penalty for p in params])
    presence = _column([p.presence_penalty for p in params])
    if frequency.any() or presence.any():
        output = torch.stack([c.output for c in counts]).to(scores.dtype)
        scores = scores - frequency * output - presence * (output > 0).to(scores.dtype)
    logits[rows] = scores


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p: the probabilities to draw from, [M, V].

    One ascending sort serves the three filters. Masking the lowest entries keeps the sort
    order, so applying them one after another in sorted space equals transformers' chain
    of warpers, each of which sorts its own input.
    """
    scores = logits / _column([p.temperature for p in params])
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
        return scores.softmax(dim=-1)
    vocab_size = scores.shape[1]
    ordered, order = scores.sort(dim=-1)
    if any(top_k):
        # transformers keeps every token scoring at least the k-th best (ties included).
        kth_index = torch.tensor([vocab_size - min(k, vocab_size) if k else 0 for k in top_k]).unsqueeze(1)
        kth = ordered.gather(1, kth_index)
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if any(p < 1.0 for p in top_p):
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - _column(top_p)
        drop[:, -1] = False  # the best token always stays
        ordered = ordered.masked_fill(drop, float("-inf"))
    if any(min_p):
        probs = ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(probs < _column(min_p) * probs[:, -1:], float("-inf"))
    scores = torch.empty_like(scores).scatter_(1, order, ordered)
    return scores.softmax(dim=-1)


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)
