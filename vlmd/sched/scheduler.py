"""Continuous batching with chunked prefill under a token budget and an encoder budget.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting
requests in arrival order while budget, sequence slots and KV blocks last. When blocks
run out for a running request, the most recently admitted request is preempted: its
blocks are freed in every KV group and it later recomputes from scratch. Every group (full
attention, sliding windows, cross-attention) takes its blocks from one pool (``kv_spec.py``),
so a request whose cross-attention table does not fit now waits like any other. No torch here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vlmd.sched.encoder_cache import EncoderCacheManager
from vlmd.sched.kv_manager import KVCacheManager
from vlmd.sched.kv_spec import KVCacheConfig
from vlmd.sched.output import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput
from vlmd.sched.request import Request, RequestStatus
from vlmd.errors import ENGINE_REJECTED, RequestRejected
from vlmd.types import EngineRequest, FinishReason, RequestDelta


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # The KV model: the pool's blocks and the layer groups that share them (kv_spec.py).
    kv_cache: KVCacheConfig
    max_num_encoder_input_tokens: int
    encoder_cache_size: int
    disable_chunked_mm_input: bool = False
    enable_prefix_caching: bool = True
    # A waiting prompt of at most this many tokens and no items is short: a step admits it
    # with the decodes alone, no encoder and no longer prefill, every other step at most (0: off; D110).
    short_prefill_tokens: int = 0
    # While more than one request is in the engine, the chunks of a step that belong to prompts
    # that are not short take at most this many tokens together (0: off; D119).
    long_prefill_step_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        for name in ("short_prefill_tokens", "long_prefill_step_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        # A request that may grow to max_model_len must fit alone, or it would preempt
        # itself forever (its cross-attention table is checked per request, at admission).
        alone = sum(self.kv_cache.peak_request_blocks(self.max_model_len, self.max_num_batched_tokens))
        if alone > self.num_kv_blocks:
            raise ValueError(
                f"the KV cache has {self.num_kv_blocks} blocks, but one request of max_model_len "
                f"{self.max_model_len} tokens can hold {alone} at once"
            )

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.kv_cache, config.enable_prefix_caching,
                                 avoid_inside_items=config.disable_chunked_mm_input)
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._dropped: list[str] = []
        self.num_preemptions = 0
        self._deferred_long = False  # the last step was a short-prompt step (D110)

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, engine_request: EngineRequest) -> None:
        request = Request(engine_request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")  # ids are ours: a bug
        if request.num_tokens >= self.config.max_model_len:
            raise RequestRejected(
                f"the prompt has {request.num_tokens} tokens; max_model_len is {self.config.max_model_len}"
            )
        # An item that could never be scheduled would block the queue behind it: its encoder
        # output must fit the encoder budget and cache, and with --disable-chunked-mm-input its
        # placeholders must fit one step (an encoder-decoder's input has none).
        largest_output = max((item.num_encoder_tokens for item in request.mm_items), default=0)
        limit = min(self.config.max_num_encoder_input_tokens, self.config.encoder_cache_size)
        if largest_output > limit:
            raise RequestRejected(f"a media item of {largest_output} tokens exceeds the encoder budget of {limit} "
                                  "(--max-num-encoder-input-tokens, --encoder-cache-size): send a smaller one")
        # Items without placeholders at one offset are all needed by the chunk that reaches it
        # (the decoder attends to them together from there): together they must fit.
        together: dict[int, int] = {}
        for item in request.mm_items:
            if item.length == 0:
                together[item.offset] = together.get(item.offset, 0) + item.num_encoder_tokens
        if max(together.values(), default=0) > limit:
            raise RequestRejected(f"the media items of this request need {max(together.values())} encoder tokens "
                                  f"at once, more than the encoder budget of {limit}")
        largest_run = max((item.length for item in request.mm_items), default=0)
        if self.config.disable_chunked_mm_input and largest_run > self.config.max_num_batched_tokens:
            raise RequestRejected(
                f"a media item of {largest_run} tokens does not fit one step: each item is scheduled in one "
                f"step, and --max-num-batched-tokens is {self.config.max_num_batched_tokens}"
            )
        # Its largest moment alone (cross-attention table included) must fit the whole pool: it
        # could never be scheduled, and would wait at the head of the queue forever.
        longest = min(self.config.max_model_len, request.num_tokens + request.sampling.max_tokens)
        alone = sum(self.config.kv_cache.peak_request_blocks(longest, self.config.max_num_batched_tokens,
                                                             request.num_cross_tokens))
        if request.num_cross_tokens and alone > self.config.num_kv_blocks:
            raise RequestRejected(
                f"the media items of this request need {request.num_cross_tokens} cross-attention tokens, which "
                f"with its text take {alone} KV blocks, more than the server's whole KV cache of "
                f"{self.config.num_kv_blocks} blocks: send fewer items, or give the KV cache more memory "
                "(--kv-cache-gb)"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestDelta]:
        deltas = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
            deltas.append(RequestDelta(request_id, [], FinishReason.ABORT))
        return deltas

    def fail_requests(self, messages: dict[str, str], num_scheduled: dict[str, int]) -> list[str]:
        """End requests whose chunk made a step raise (``messages``: id -> error), undoing
        what their chunk left: blocks it was to fill are no longer findable by prefix hash
        (their KV may be unwritten). A request that adopted such a block in the same step
        (same prefix, admitted behind the culprit) is preempted to recompute from scratch;
        their ids are returned."""
        suspect: set[tuple[int | None, int]] = set()
        for request_id in messages:
            request = self.requests.get(request_id)
            if request is None:
                continue
            chunk_start = request.num_computed_tokens - num_scheduled.get(request_id, 0)
            suspect.update(self.kv.forget_hashes_from(request_id, chunk_start // self.config.block_size))
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ERROR)
        tainted = [
            request for request in self.running
            if request.request_id in num_scheduled and suspect.intersection(self.kv.held_blocks(request.request_id))
        ]
        for request in tainted:
            self.running.remove(request)
            self._preempt(request)
        return [request.request_id for request in tainted]

    def forget_encoder_outputs(self, identifiers: set[str]) -> None:
        """Outputs that were allocated but never computed (their encoder raised)."""
        for identifier in identifiers:
            self.encoder_cache.forget(identifier)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step --------------------------------------------------------------------

    def _is_short(self, request: Request) -> bool:
        return not request.mm_items and request.num_tokens <= self.config.short_prefill_tokens

    def _long_chunk_cap(self, request: Request, long_bound: int, long_taken: int) -> int | None:
        """The most tokens the step's long-prefill bound lets ``request``'s chunk take (None:
        no cap: the bound is off or the engine holds this request alone, or its prompt is
        short), given ``long_taken`` tokens of long chunks already in the step (D119).

        With ``disable_chunked_mm_input`` an item goes in one step: the step's first long
        chunk may reach the end of an item it starts at or inside, past the bound, or a
        request at an item longer than the bound could never move."""
        if long_bound <= 0 or self._is_short(request):
            return None
        cap = max(0, long_bound - long_taken)
        if long_taken == 0 and self.config.disable_chunked_mm_input:
            start = request.num_computed_tokens
            for item in request.mm_items:
                if item.offset <= start < item.end:
                    cap = max(cap, item.end - start)
        return cap

    def schedule(self) -> SchedulerOutput:
        """One step. Normally: running requests first (decodes and prefill chunks), then the
        waiting ones in arrival order. When a short prompt waits (``short_prefill_tokens``)
        and the last step was not such a step: the decodes and the short prompts alone
        (ahead of longer waiting ones), so their first token waits for no encoder and no
        long prefill; the longer prefills go on the next step (D110). While more than one
        request is in the engine, the chunks of prompts that are not short take at most
        ``long_prefill_step_tokens`` of a step together, so the step that a newcomer waits for
        stays short; a request alone keeps the whole budget (D119)."""
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_encoder_input_tokens)
        long_bound = self.config.long_prefill_step_tokens if len(self.running) + len(self.waiting) > 1 else 0
        long_taken = 0  # tokens of the step's long prefill chunks so far
        short_step = (self.config.short_prefill_tokens > 0 and not self._deferred_long
                      and any(self._is_short(request) for request in self.waiting))
        self._deferred_long = short_step
        preempted = False
        # Window blocks that no running request's next query can see go back first: they
        # are what this step's allocations may take (kv_groups.py).
        for request in self.running:
            self.kv.release_out_of_window(request.request_id, request.num_computed_tokens)

        # Decodes later in the batch keep their token: a prefill chunk before them takes what
        # the budget leaves after them (D110).
        decodes_left = sum(1 for request in self.running if request.num_tokens - request.num_computed_tokens == 1)
        index = 0
        while index < len(self.running) and budget.tokens > 0:
            request = self.running[index]
            is_decode = request.num_tokens - request.num_computed_tokens == 1
            if is_decode:
                decodes_left -= 1
            elif short_step:
                index += 1  # a prefill: next step
                continue
            chunk_budget = budget if is_decode else _Budget(max(0, budget.tokens - decodes_left), budget.encoder)
            cap = None if is_decode else self._long_chunk_cap(request, long_bound, long_taken)
            if cap is not None:
                if cap == 0:  # the step's long prefill tokens are spent: next step
                    index += 1
                    continue
                chunk_budget = _Budget(min(chunk_budget.tokens, cap), chunk_budget.encoder)
            num_new, encoder_inputs, encoder_hits = self._plan_chunk(request, chunk_budget)
            if num_new == 0:
                index += 1
                continue
            new_blocks, preempted_any = self._allocate_or_preempt(request, num_new)
            preempted = preempted or preempted_any
            if new_blocks is None:  # the request preempted itself
                break
            out.cached_requests.append(CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens))
            self._note_snapshots(out, request)
            self._commit_chunk(out, request, num_new, encoder_inputs, encoder_hits, budget)
            if cap is not None:
                long_taken += num_new
            index += 1

        candidates = [request for request in self.waiting if self._is_short(request)] if short_step else self.waiting
        for request in list(candidates):
            if preempted or budget.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            computed = self.kv.computed_blocks(request)
            request.num_computed_tokens = computed.num_blocks * self.config.block_size
            # Its cap counts only what it computes: a prefix hit is not prefill work.
            cap = self._long_chunk_cap(request, long_bound, long_taken)
            chunk_budget = budget if cap is None else _Budget(min(budget.tokens, cap), budget.encoder)
            num_new, encoder_inputs, encoder_hits = (
                (0, [], 0) if chunk_budget.tokens <= 0 else self._plan_chunk(request, chunk_budget, admitting=True))
            if (
                num_new == 0
                or self.kv.allocate_slots(request, request.num_computed_tokens + num_new, computed) is None
            ):
                # Planning took references on resident outputs. A waiting request must hold
                # none: a running one could then be kept from encoder slots by a request that
                # is itself waiting for the running one's KV blocks, and neither would move.
                self._release_encoder_items(request)
                request.num_computed_tokens = 0
                break
            self.kv.record_lookup(request.num_tokens, request.num_computed_tokens)
            if request.status is RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = request.num_computed_tokens
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:  # a short prompt ahead of longer ones
                self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests.append(self._new_request_data(request, computed.state_sources))
            self._note_snapshots(out, request)
            self._commit_chunk(out, request, num_new, encoder_inputs, encoder_hits, budget)
            if cap is not None:
                long_taken += num_new

        out.evicted_encoder_identifiers = self.encoder_cache.take_evicted()
        out.dropped_request_ids, self._dropped = self._dropped, []
        return out

    def _plan_chunk(self, request: Request, budget: "_Budget", admitting: bool = False) -> tuple[int, list[int], int]:
        """How many tokens of ``request`` to compute now, which items to encode, and how
        many items this chunk found already encoded (for the hit-rate counters).

        ``admitting``: the first chunk of a (re)admission. It needs every item without
        placeholders before it too (a prefix hit past their offset): the runner derives the
        request's cross state from them in this chunk."""
        start = request.num_computed_tokens
        # A chunk ends where a recurrent-state snapshot is due, if one lies inside it (D105).
        num_new = self.kv.chunk_limit(request, start, min(request.num_tokens - start, budget.tokens))
        end = start + num_new
        to_encode: list[int] = []
        planned: set[str] = set()
        pending = 0
        hits = 0
        for index, item in enumerate(request.mm_items):
            if item.offset >= end:
                break
            if item.use_end <= start and not (admitting and item.length == 0):
                continue  # consumed (an item without placeholders: past its offset)
            if self.config.disable_chunked_mm_input and item.end > end:
                # Checked before the cache: an item must go in one step even when its output
                # is already resident (or held for an earlier occurrence of the same image).
                # A chunk that starts inside it (a prefix hit past its start) must reach its
                # end too (a bidirectional span's queries read its later keys), or wait.
                return max(item.offset - start, 0), to_encode, hits
            if item.identifier in request.held_encoder_items:
                continue
            if item.identifier in planned:
                # The same image twice in this chunk: one encode, one allocation, one reference.
                continue
            if self.encoder_cache.acquire_if_resident(request.request_id, item.identifier):
                request.held_encoder_items.add(item.identifier)
                hits += 1
                continue
            if not self.encoder_cache.can_allocate(item.num_encoder_tokens, budget.encoder - pending, pending):
                # Compute the text before the item now; if the chunk already starts inside
                # the item (a prefix hit past its start), this request waits for room.
                return max(item.offset - start, 0), to_encode, hits
            pending += item.num_encoder_tokens
            to_encode.append(index)
            planned.add(item.identifier)
        return num_new, to_encode, hits

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[dict[int, list[int]] | None, bool]:
        """Allocate blocks, preempting from the back of ``running`` until they fit.

        Returns the new block ids per group (None if ``request`` itself was preempted) and whether
        anything was preempted.
        """
        preempted_any = False
        while True:
            new_blocks = self.kv.allocate_slots(request, request.num_computed_tokens + num_new)
            if new_blocks is not None:
                return new_blocks, preempted_any
            victim = self.running.pop()
            self._preempt(victim)
            preempted_any = True
            if victim is request:
                return None, True

    def _commit_chunk(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        encoder_inputs: list[int],
        encoder_hits: int,
        budget: "_Budget",
    ) -> None:
        self.encoder_cache.record_lookups(encoder_hits + len(encoder_inputs), encoder_hits)
        for index in encoder_inputs:
            item = request.mm_items[index]
            self.encoder_cache.allocate(request.request_id, item.identifier, item.num_encoder_tokens)
            request.held_encoder_items.add(item.identifier)
            budget.encoder -= item.num_encoder_tokens
        if encoder_inputs:
            out.scheduled_encoder_inputs[request.request_id] = encoder_inputs
        out.num_scheduled_tokens[request.request_id] = num_new
        out.total_num_scheduled_tokens += num_new
        budget.tokens -= num_new
        request.num_computed_tokens += num_new

    def _note_snapshots(self, out: SchedulerOutput, request: Request) -> None:
        snapshots = self.kv.new_snapshots(request.request_id)
        if snapshots:
            out.state_snapshots[request.request_id] = snapshots

    def _new_request_data(self, request: Request, state_sources: dict[int, list[int]] | None = None) -> NewRequestData:
        stop_ids = tuple(request.eos_token_ids) if not request.sampling.ignore_eos else ()
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            mm_items=request.mm_items,
            sampling=request.sampling,
            block_tables=self.kv.tables(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            stop_token_ids=stop_ids + tuple(request.sampling.stop_token_ids),
            family_state=request.family_state,
            state_sources=dict(state_sources or {}),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._release_encoder_items(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._dropped.append(request.request_id)

    # ---- results ---------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        for request_id in out.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            self._release_consumed_encoder_items(request)
            refusal = result.grammar_rejected.get(request_id)
            if refusal is not None:  # its KV is sound: only the request ends, its blocks stay cached
                self.running.remove(request)
                self._finish(request, FinishReason.ERROR)
                deltas.append(RequestDelta(request_id, [], FinishReason.ERROR, error=refusal,
                                           error_status=ENGINE_REJECTED,
                                           num_prompt_tokens=request.num_prompt_tokens,
                                           num_cached_tokens=request.num_cached_tokens))
                continue
            token_id = result.sampled_token_ids.get(request_id)
            if token_id is None:
                continue
            request.all_token_ids.append(token_id)
            if request_id in result.grammar_completed:
                reason = FinishReason.STOP  # the answer is whole, even if it also hit max_tokens
            else:
                reason = request.stop_reason_for(token_id, self.config.max_model_len)
            logprob = result.logprobs.get(request_id)
            delta = RequestDelta(
                request_id,
                [token_id],
                reason,
                logprobs=[logprob] if logprob is not None else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
            )
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            deltas.append(delta)
        return deltas

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)
        self._release_encoder_items(request)
        self.requests.pop(request.request_id, None)
        self._dropped.append(request.request_id)

    def _release_consumed_encoder_items(self, request: Request) -> None:
        if not request.held_encoder_items:
            return
        # The same image may appear twice in one prompt: keep it until its last use.
        still_needed = {
            item.identifier for item in request.mm_items if item.use_end > request.num_computed_tokens
        }
        for identifier in list(request.held_encoder_items - still_needed):
            request.held_encoder_items.discard(identifier)
            self.encoder_cache.release(request.request_id, identifier)

    def _release_encoder_items(self, request: Request) -> None:
        for identifier in request.held_encoder_items:
            self.encoder_cache.release(request.request_id, identifier)
        request.held_encoder_items.clear()


@dataclass
class _Budget:
    tokens: int
    encoder: int
