"""A request as the scheduler sees it: token ids, progress, status. No tensors."""

from __future__ import annotations

import enum

from vlmd.sched.cross_kv import cross_tokens_of
from vlmd.types import EngineRequest, FinishReason, MultiModalItem, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Scheduler-side state of one request.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache (or are being
    written by the step just scheduled). A request needs work while it is below
    ``num_tokens``: a prefill chunk, or the one-token decode of its last sample.
    """

    def __init__(self, engine_request: EngineRequest):
        self.request_id = engine_request.request_id
        self.sampling: SamplingParams = engine_request.sampling
        self.eos_token_ids = frozenset(engine_request.eos_token_ids)
        self.mm_items: list[MultiModalItem] = sorted(engine_request.mm_items, key=lambda it: it.offset)
        # Encoder tokens its decoder cross-attends to (an encoder-decoder's): its cross table's size.
        self.num_cross_tokens = cross_tokens_of(self.mm_items)
        self.num_prompt_tokens = len(engine_request.prompt_token_ids)
        self.all_token_ids: list[int] = list(engine_request.prompt_token_ids)
        self.arrival_time = engine_request.arrival_time
        # Carried to the runner untouched; the scheduler never looks inside.
        self.family_state = engine_request.family_state  # the model's, never read here
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_hashes: list[bytes] = []  # of full blocks, filled lazily by the KV manager
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # Identifiers of encoder outputs this request holds a reference on.
        self.held_encoder_items: set[str] = set()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_reason_for(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Decide whether ``token_id`` (just appended) ends the request."""
        params = self.sampling
        if self.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
