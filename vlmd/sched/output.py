"""What the scheduler hands the runner each step, and what comes back. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmd.types import MultiModalItem, SamplingParams, TokenLogprob


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped, after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt plus any output sampled before a preemption
    num_prompt_tokens: int
    mm_items: list[MultiModalItem]
    sampling: SamplingParams
    # KV group index -> the request's table in that group (sched/kv_spec.py): full attention's
    # grows, a window's has kv_managers.FREED where it gave a block back, a cross-attention
    # table is whole from the start.
    block_tables: dict[int, list[int]]
    num_computed_tokens: int
    stop_token_ids: tuple[int, ...]  # eos + stop ids, masked out until min_tokens
    family_state: Any = None  # the family's per-request object, for the model
    # Recurrent-state group -> the snapshot pages (a prefix hit's) the runner copies the
    # request's state from before its first chunk (sched/kv_managers.py, D105).
    state_sources: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class CachedRequestData:
    """A request the runner already tracks: only what changed."""

    request_id: str
    # KV group index -> block ids appended to the request's table there (groups with none
    # left out). Blocks a window left behind are not sent: the runner never reads them.
    new_block_ids: dict[int, list[int]]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Batch order: request id -> tokens to compute this step.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Request id -> indices into its mm_items that must be encoded this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder outputs the runner may drop now.
    evicted_encoder_identifiers: list[str] = field(default_factory=list)
    # Requests the runner must forget (finished, aborted or preempted).
    dropped_request_ids: list[str] = field(default_factory=list)
    # Request id -> recurrent-state group -> pages the runner copies the request's state into
    # once this step's chunk has run: a snapshot for later prefix hits (D105).
    state_snapshots: dict[str, dict[int, list[int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class RunnerOutput:
    """Sampled tokens for the requests whose scheduled chunk reached their last token."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Requests whose structured-output grammar is complete: they end with "stop" now.
    grammar_completed: set[str] = field(default_factory=set)
    # Requests whose grammar refused the token its own mask allowed (id -> reason): they end
    # with a client error (vlmd.errors.ENGINE_REJECTED), the others in the step go on.
    grammar_rejected: dict[str, str] = field(default_factory=dict)
    encoder_seconds: float = 0.0
