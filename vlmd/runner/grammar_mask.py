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
    bitmask = torch.stack([states[row].grammar.next_mask for row in rows])
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def advance_grammars(states: Sequence, tokens: Sequence[int]) -> set[str]:
    """Feed each constrained row its sampled token; return the requests whose grammar is
    complete (a stop token was accepted, or nothing but a stop token may follow)."""
    advanced = []
    completed: set[str] = set()
    for state, token in zip(states, tokens):
        grammar: GrammarState | None = getattr(state, "grammar", None)
        if grammar is None:
            continue
        grammar.next_mask = None
        if not grammar.matcher.accept(token):
            raise RuntimeError(f"request {state.request_id}: the grammar rejects sampled token {token}")
        if grammar.matcher.is_terminated():
            completed.add(state.request_id)
        else:
            advanced.append((state, grammar))
    if advanced:
        masks = _fill_next_masks([grammar for _, grammar in advanced])
        open_rows = (masks & _non_stop_bits(advanced[0][1].compiler)).any(dim=1).tolist()
        for (state, _), still_open in zip(advanced, open_rows):
            if not still_open:
                completed.add(state.request_id)
    return completed


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 (bit j of word i = token 32 i + j) -> [rows, vocab_size] bool.

    Logits wider than the mask (a padded embedding) are forbidden past the mask's end.
    """
    bits = ((bitmask.unsqueeze(-1) >> _BIT) & 1).bool().view(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


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
