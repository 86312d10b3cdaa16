"""Picking the next token per row: the logits processors in order, then argmax or a draw.

The order (documented in ``logits_processors``) is: token constraints, the model's own
rule, logit bias, penalties, the structured-output mask; greedy rows take the argmax there;
sampled rows are warped (temperature, top-k, top-p, min-p) into probabilities and drawn
from: seeded rows each with their own generator, the others in one draw.

A row that holds NaN or +inf, or no finite value at all (a bad checkpoint, an overflow), has
no token to give: an argmax there is arbitrary and a draw lands past the vocabulary. So
``sample`` raises ``NonFiniteLogits`` naming its requests before anything is chosen or any
state advanced, and the engine's fault isolation (``vlmd/engine/isolation.py``, D12) re-runs
the step without them and fails those requests alone, with a 500 that names the cause; the
step's other rows go on. A sampled row whose processed distribution has no mass (nothing
left to draw) is refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmd.runner.logits_processors import apply_logit_bias, apply_penalties, apply_token_constraints, warp
from vlmd.runner.grammar_mask import apply_grammar_masks
from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import TokenLogprob

__all__ = ["NonFiniteLogits", "sample", "apply_token_constraints"]


class NonFiniteLogits(RuntimeError):
    """Rows with no token to give; ``request_ids`` are their requests."""

    def __init__(self, request_ids: list[str], what: str):
        super().__init__(f"the logits of request(s) {', '.join(request_ids)} {what}: no token can be chosen")
        self.request_ids = request_ids


def refuse_non_finite_rows(row_max: torch.Tensor, states: list[RunnerRequestState]) -> None:
    """Raise ``NonFiniteLogits`` for the rows holding NaN or +inf, or nothing finite (-inf
    alone is a mask, and fine), from each row's max (``[N]``): NaN if any value is, +inf if
    any is, -inf if all are."""
    bad = ~torch.isfinite(row_max)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise NonFiniteLogits([states[row].request_id for row in rows],
                              "are not finite (NaN or +inf, or no finite value)")


def sample(
    logits: torch.Tensor,
    states: list[RunnerRequestState],
    default_generator: torch.Generator,
    process_logits: Callable[[torch.Tensor, list[RunnerRequestState]], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row of ``logits`` ([N, vocab], float32; modified in place).

    ``process_logits`` is the model's own rule, if it has one (Whisper's timestamp rules);
    it runs after the per-request token constraints, as transformers runs a generation
    config's suppression before the model's processors.
    """
    # One pass gives each row's max (the finiteness check) and its argmax (the first maximal
    # index, as ``argmax`` gives it): a plain greedy step reads the logits once.
    row_max, argmax = logits.max(dim=-1)
    refuse_non_finite_rows(row_max, states)
    if process_logits is None and all(state.plain_greedy for state in states):
        # Every row is a plain argmax (``request_state.is_plain_greedy``): the processors
        # below would leave the logits as they are, and nothing is drawn or reported.
        return argmax.tolist(), [None] * len(states)
    # Log-probs describe the model's own distribution, before any processor (vLLM's
    # default "raw" log-probs), unless a request asks for the processed ones.
    want_logprobs = any(state.sampling.logprobs is not None for state in states)
    logprobs_table = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    apply_token_constraints(logits, states)
    if process_logits is not None:
        logits = process_logits(logits, states)
    apply_logit_bias(logits, states)
    apply_penalties(logits, states)
    # Structured outputs last: whatever the other rules leave, the grammar has the final word.
    apply_grammar_masks(logits, states)
    if logprobs_table is not None:
        processed = [row for row, state in enumerate(states) if state.sampling.processed_logprobs]
        if processed:  # before the warp: temperature shapes the draw, not the reported figure
            logprobs_table[processed] = torch.log_softmax(logits[processed], dim=-1)

    tokens = logits.argmax(dim=-1).tolist()
    sampled = [row for row, state in enumerate(states) if not state.sampling.is_greedy]
    if sampled:
        probs = warp(logits[sampled], [states[row].sampling for row in sampled])
        for row, token in zip(sampled, _draw(probs, [states[row] for row in sampled], default_generator)):
            tokens[row] = token

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


def _draw(probs: torch.Tensor, states: list[RunnerRequestState], default_generator: torch.Generator) -> list[int]:
    """One token per row of ``probs`` by inverting its cumulative distribution: a seeded
    request takes its uniform number from its own generator (so its answer does not depend
    on the batch), the rest from the shared one. (``torch.multinomial`` costs ~1.7 ms per
    32k-token row on this CPU; the float64 cumsum and search cost ~0.1 ms per row.)"""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    empty = ~(total.squeeze(1) > 0)  # no mass, or NaN: the search would land past the vocabulary
    if bool(empty.any()):
        raise NonFiniteLogits([states[row].request_id for row in empty.nonzero().flatten().tolist()],
                              "leave no probability to draw from once processed")
    device = probs.device  # the generators draw on the logits' device (the runner's)
    uniform = torch.empty(len(states), 1, dtype=torch.float64, device=device)
    unseeded = []
    for index, state in enumerate(states):
        generator = state.generator_for_next_token(device)
        if generator is None:
            unseeded.append(index)
        else:
            uniform[index] = torch.rand(1, generator=generator, dtype=torch.float64, device=device)
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), 1, generator=default_generator, dtype=torch.float64,
                                       device=device)
    # Strictly below the total, so the search lands on a token of non-zero probability.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).tolist()
