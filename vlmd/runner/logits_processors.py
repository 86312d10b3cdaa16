"""The logits processors, batched over the rows of one step (no loop over the vocabulary).

``sampler.sample`` applies them in this order; each step is named after the transformers
processor it equals on the same inputs (tests/test_sampler.py checks each one):

1. ``apply_token_constraints``: min_tokens' stop-token mask, suppress lists, allowed ids
   (``MinNewTokensLengthLogitsProcessor``, ``SuppressTokens[AtBegin]LogitsProcessor``);
2. the model's own rule, if any (Whisper's timestamp rules);
3. ``apply_logit_bias``: OpenAI's ``logit_bias`` (``SequenceBiasLogitsProcessor`` with
   one-token sequences);
4. ``apply_penalties``: repetition (``RepetitionPenaltyLogitsProcessor``, prompt and
   output), then OpenAI's frequency and presence penalties (output only), as vLLM does;
5. ``grammar_mask.apply_grammar_masks``: structured outputs forbid (-inf) every token that
   would leave the grammar; last, so no bias can lift a forbidden token (a -inf stays -inf
   under bias and penalties, so the order changes nothing for the allowed ones); greedy
   rows take their argmax after this step;
6. ``warp`` (sampled rows): temperature, top-k, top-p, min-p (``TemperatureLogitsWarper``,
   ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, in transformers' order)
   into the probabilities the token is drawn from (``sampler.draw``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vlmd.types import SamplingParams

if TYPE_CHECKING:  # the request state derives its plain-greedy flag from this module's rule
    from vlmd.runner.request_state import RunnerRequestState


def leaves_logits_unchanged(sampling: SamplingParams, stop_token_ids: tuple[int, ...]) -> bool:
    """Whether no processor of this module would ever touch a request's row: no min_tokens
    stop-token mask, suppress list, allowed ids, logit bias, penalty or grammar. Kept here,
    beside the processors, so a new one is added to this rule in the same place."""
    return (not (stop_token_ids and sampling.min_tokens) and not sampling.suppress_token_ids
            and not sampling.begin_suppress_token_ids and sampling.allowed_token_ids is None
            and not sampling.logit_bias and not sampling.has_penalties and sampling.grammar is None)


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

    No full sort of the vocabulary (on this CPU one sort of 8 x 32k logits takes ~55 ms):
    top-k needs only the k best, top-p only the best tokens that carry ``top_p`` of the
    mass (found with a growing ``topk``), min-p only the maximum.
    """
    scores = logits / _column([p.temperature for p in params])
    top_k = [p.top_k for p in params]
    if any(top_k):
        scores = _top_k(scores, top_k)
    rows = [row for row, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        scores[rows] = _top_p(scores[rows], _column([params[row].top_p for row in rows]))
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = scores.softmax(dim=-1)
        threshold = _column(min_p) * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < threshold, float("-inf"))
    return scores.softmax(dim=-1)


def _top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep every token scoring at least the k-th best (ties included, as transformers)."""
    vocab_size = scores.shape[1]
    best = scores.topk(min(max(top_k), vocab_size), dim=-1).values  # sorted, best first
    kth = best.gather(1, torch.tensor([[min(k, vocab_size) - 1 if k else 0] for k in top_k]))
    kth = torch.where(torch.tensor(top_k).unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop a token when the tokens ranked above it already hold ``top_p`` of the mass
    (transformers: its ascending cumulative mass is at most ``1 - top_p``).

    Only the best ``k`` tokens are ranked, ``k`` growing until they hold ``top_p`` in every
    row: every token outside then has at least that much above it, so it is dropped too.
    """
    probs = scores.softmax(dim=-1)
    vocab_size = probs.shape[1]
    k = min(256, vocab_size)
    while True:
        if k == vocab_size:  # a flat distribution: rank everything
            values, order = probs.sort(dim=-1, descending=True)
            break
        values, order = probs.topk(k, dim=-1)
        if bool((values.sum(dim=-1, keepdim=True) >= top_p).all()):
            break
        k = vocab_size if k * 8 > vocab_size // 4 else k * 8
    above = values.cumsum(dim=-1) - values
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, above < top_p)
    return scores.masked_fill(~keep, float("-inf"))


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)
