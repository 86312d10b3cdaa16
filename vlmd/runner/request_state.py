"""What the runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmd.runner.token_counts import TokenCounts
from vlmd.runner.grammar_mask import GrammarState
from vlmd.runner.logits_processors import leaves_logits_unchanged
from vlmd.sched.cross_kv import cross_tokens_of
from vlmd.sched.output import NewRequestData
from vlmd.types import MultiModalItem, SamplingParams


@dataclass
class RunnerRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    mm_items: list[MultiModalItem]
    sampling: SamplingParams
    # KV group index -> the request's table there (sched/kv_spec.py). A window group's entries
    # the window has left behind may name blocks given to others since: attention never reads them.
    block_tables: dict[int, list[int]]
    num_computed_tokens: int
    stop_token_ids: tuple[int, ...]
    family_state: Any = None  # the family's per-request object (the model reads it)
    # Encoder-decoder models: its cross tokens (its table is the cross-attention group's), and
    # whether its cross-attention K/V are written there yet (derived once from the encoder
    # output, in the first chunk that reaches its items: runner/cross_cache.py).
    num_cross_tokens: int = 0
    cross_ready: bool = False
    # Penalized requests only: counts of the tokens seen, built at the first sample.
    token_counts: TokenCounts | None = None
    # Structured output: the matcher, in the state this request's generated tokens lead to.
    grammar: GrammarState | None = None
    # Derived once from what never changes for the request (``__post_init__``):
    # no chunk from this position on reads an encoder output (the largest ``use_end`` of its
    # items), so a decode skips the item walks;
    items_end: int = field(init=False, default=0)
    # greedy with no logits processor and no log-probs: its token is the argmax alone
    # (``sampler.sample`` skips the processors for a batch of such rows).
    plain_greedy: bool = field(init=False, default=False)
    # The model's positions of the tokens ahead, asked of the family once for a run of
    # decodes (``batch.py``): (first token index, [rows, n] tensor, or None for plain ones).
    positions_ahead: tuple[int, Any] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.items_end = max((item.use_end for item in self.mm_items), default=0)
        self.plain_greedy = is_plain_greedy(self.sampling, self.stop_token_ids)

    @classmethod
    def from_new(cls, data: NewRequestData) -> "RunnerRequestState":
        return cls(
            request_id=data.request_id,
            token_ids=list(data.token_ids),
            num_prompt_tokens=data.num_prompt_tokens,
            mm_items=data.mm_items,
            sampling=data.sampling,
            block_tables={group: list(table) for group, table in data.block_tables.items()},
            num_computed_tokens=data.num_computed_tokens,
            stop_token_ids=data.stop_token_ids,
            family_state=data.family_state,
            num_cross_tokens=cross_tokens_of(data.mm_items),
            # Rebuilt from scratch on every (re)admission: after a preemption the request
            # brings back the tokens it generated, and the matcher replays them.
            grammar=GrammarState(data.sampling.grammar, data.token_ids[data.num_prompt_tokens :])
            if data.sampling.grammar is not None
            else None,
        )

    def append_token(self, token_id: int) -> None:
        """Record a sampled token (and count it, for a penalized request)."""
        self.token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)

    def token_counts_for(self, vocab_size: int) -> TokenCounts:
        if self.token_counts is None:
            prompt = self.token_ids[: self.num_prompt_tokens]
            self.token_counts = TokenCounts(prompt, self.token_ids[self.num_prompt_tokens :], vocab_size)
        return self.token_counts

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def masks_stop_tokens(self) -> bool:
        return bool(self.stop_token_ids) and self.num_output_tokens < self.sampling.min_tokens

    def generator_for_next_token(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A seeded request's generator depends only on (seed, output index), so a
        sampled answer is the same whatever else shares the batch or after preemption
        (on one device type: CPU and CUDA generators give different streams)."""
        if self.sampling.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(hash((self.sampling.seed, self.num_output_tokens)) & (2**63 - 1))


def is_plain_greedy(sampling: SamplingParams, stop_token_ids: tuple[int, ...]) -> bool:
    """Whether every token of a request is the plain argmax of its logits: greedy, no
    log-probs, and no logits processor that would touch its row."""
    return sampling.is_greedy and sampling.logprobs is None and leaves_logits_unchanged(sampling, stop_token_ids)
