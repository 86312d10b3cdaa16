"""Structured outputs in the sampler: one bitmask per step for the rows that have a grammar.

A constrained request carries a compiled grammar (``SamplingParams.grammar``, compiled on
the preprocessing pool, never here). The runner keeps one matcher per request
(``GrammarState``), built from the grammar and replayed over the request's generated tokens,
so a request that was preempted and comes back with its tokens resumes in exactly the state
those tokens lead to. After each accepted token the next-token mask is computed at once:
the next step needs it anyway, and it tells whether the grammar is complete (nothing but a
stop token may follow), in which case the request ends with "stop" without another step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BIT = torch.arange(32, dtype=torch.int32)
_NEG_INF_BITS = -8388608  # 0xFF800000, float32 -inf, as a signed int32


class GrammarState:
    """One request's matcher and the mask of tokens it may sample next."""

    def __init__(self, compiled, generated_token_ids: Sequence[int]):
        self.compiler = compiled.compiler  # one per server: vocabulary, stop tokens, mask filling
        self.matcher = compiled.new_matcher()
        for token in generated_token_ids:
            if not self.matcher.accept(token):
                raise RuntimeError(f"the grammar rejects token {token} the request already generated")
        self.next_mask: torch.Tensor | None = None  # [ceil(vocab / 32)] int32, bit set = allowed


def apply_grammar_masks(logits: torch.Tensor, states: Sequence) -> None:
    """Set, in place, the logits of tokens the grammar forbids to -inf (constrained rows only)."""
    # getattr: the sampler's contract is any per-row state; only the runner's carry a grammar.
    rows = [row for row, state in enumerate(states) if getattr(state, "grammar", None) is not None]
    if not rows:
        return
    missing = [states[row].grammar for row in rows if states[row].grammar.next_mask is None]
    if missing:
        _fill_next_masks(missing)
    # The library writes masks into host memory; the logits may live on the runner's device.
    bitmask = torch.stack([states[row].grammar.next_mask for row in rows]).to(logits.device)
    apply_bitmask(logits, rows, bitmask)


def advance_grammars(states: Sequence, tokens: Sequence[int]) -> tuple[set[str], dict[str, str]]:
    """Feed each constrained row its sampled token. Returns the requests whose grammar is
    complete (a stop token was accepted, or nothing but a stop token may follow) and those
    whose grammar refused the sampled token (id -> reason).

    A refusal means the mask and the matcher disagree (a grammar the library compiled but
    cannot follow, e.g. one that can never be satisfied). It is that request's problem alone:
    it ends with a client error naming its constraint, while the step's other rows go on;
    raising here would fail the whole step and re-run it for nothing.
    """
    advanced = []
    completed: set[str] = set()
    rejected: dict[str, str] = {}
    for state, token in zip(states, tokens):
        grammar: GrammarState | None = getattr(state, "grammar", None)
        if grammar is None:
            continue
        grammar.next_mask = None
        if not grammar.matcher.accept(token):
            rejected[state.request_id] = (
                f"the structured-output constraint cannot be followed: its grammar refused token {token}, "
                f"which its own mask allowed ({grammar.matcher.error or 'no reason given'}); "
                "the constraint is likely unsatisfiable"
            )
        elif grammar.matcher.is_terminated():
            completed.add(state.request_id)
        else:
            advanced.append((state, grammar))
    if advanced:
        masks = _fill_next_masks([grammar for _, grammar in advanced])
        open_rows = (masks & _non_stop_bits(advanced[0][1].compiler)).any(dim=1).tolist()
        for (state, _), still_open in zip(advanced, open_rows):
            if not still_open:
                completed.add(state.request_id)
    return completed, rejected


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Forbid (-inf), in place, the tokens whose bit is clear in ``bitmask[i]`` on ``logits[rows[i]]``.

    ``bitmask`` is [len(rows), words] int32, bit j of word i = token 32 i + j. Pure integer
    work on the float bits (AND keeps an allowed logit, OR writes -inf's bit pattern): torch's
    masked_fill / where with a bool mask ran ~100x slower on this CPU (8 ms per 1M logits),
    and row by row keeps the temporaries in cache (128k vocab, 8 rows: ~1 ms in all).
    Logits past the mask (a padded embedding) are forbidden too.
    """
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    bit = _BIT.to(bitmask.device)
    for index, row in enumerate(rows):
        keep = ((bitmask[index].unsqueeze(-1) >> bit) & 1).neg_().view(-1)[:covered]  # -1 allowed, 0 not
        target = logits[row]
        if covered < vocab:
            target[covered:] = float("-inf")
        bits = target[:covered].view(torch.int32)
        bits.bitwise_and_(keep).bitwise_or_(keep.bitwise_not().bitwise_and_(_NEG_INF_BITS))


def _fill_next_masks(grammars: list[GrammarState]) -> torch.Tensor:
    """Compute every matcher's next-token mask into one tensor; each state keeps its row."""
    compiler = grammars[0].compiler
    masks = torch.zeros((len(grammars), compiler.mask_words), dtype=torch.int32)
    compiler.fill_masks([g.matcher for g in grammars], masks.data_ptr())
    for row, grammar in enumerate(grammars):
        grammar.next_mask = masks[row]
    return masks


_NON_STOP_CACHE: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}


def _non_stop_bits(compiler) -> torch.Tensor:
    """Every bit set but the stop tokens': a mask ANDed with it is zero iff only stop tokens remain."""
    words = compiler.mask_words
    key = (tuple(compiler.stop_token_ids), words)
    bits = _NON_STOP_CACHE.get(key)
    if bits is None:
        packed = [0xFFFFFFFF] * words
        for token in compiler.stop_token_ids:
            word, bit = divmod(token, 32)
            packed[word] &= ~(1 << bit) & 0xFFFFFFFF
        bits = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in packed], dtype=torch.int32)
        _NON_STOP_CACHE[key] = bits
    return bits
