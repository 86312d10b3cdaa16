"""The scheduler driven without tensors: a fake runner that checks every promise.

Shared by the scheduler, prefix-cache and encoder-decoder scheduling tests.
"""

from __future__ import annotations

from collections import Counter


from vlmd.sched.block_pool import blocks_needed
from vlmd.sched.kv_managers import FREED
from vlmd.sched.kv_spec import (
    CrossAttention, FullAttention, RecurrentState, SlidingWindow, build_kv_cache_config, first_visible_block,
)
from vlmd.sched.output import RunnerOutput, SchedulerOutput
from vlmd.sched.scheduler import Scheduler, SchedulerConfig
from vlmd.types import EngineRequest, FinishReason, MultiModalItem, RequestDelta, SamplingParams

EOS = 2
FILLER = 7  # what the fake runner samples when a request has no script


def make_scheduler(*, block_size: int = 4, num_kv_blocks: int = 128, layers=(FullAttention(),),
                   slot_bytes: int = 0, **overrides) -> Scheduler:
    """``layers``: the KV model's layer kinds (sched/kv_spec.py); one full-attention layer
    by default (one group, as every model without windows or cross-attention)."""
    config = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        max_num_encoder_input_tokens=64,
        encoder_cache_size=64,
        # Most tests reuse the same token ids across requests; prefix caching has its own tests.
        enable_prefix_caching=False,
    )
    config.update(overrides)
    if "max_model_len" not in overrides:
        # A small test cache also bounds the context: the config rejects a cache that
        # cannot hold one max_model_len sequence.
        config["max_model_len"] = min(512, num_kv_blocks * block_size)
    kv_cache = build_kv_cache_config(layers, block_size, num_kv_blocks, slot_bytes)
    return Scheduler(SchedulerConfig(kv_cache=kv_cache, **config))


def image(identifier: str, offset: int, length: int) -> MultiModalItem:
    return MultiModalItem(modality="image", identifier=identifier, offset=offset, length=length)


def make_request(
    request_id: str,
    num_prompt: int,
    *,
    items: tuple[MultiModalItem, ...] = (),
    eos: tuple[int, ...] = (EOS,),
    **sampling,
) -> EngineRequest:
    sampling.setdefault("max_tokens", 16)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=[100 + i for i in range(num_prompt)],
        sampling=SamplingParams(**sampling),
        mm_items=list(items),
        eos_token_ids=eos,
    )


class _State:
    def __init__(self, data):
        self.token_ids = list(data.token_ids)
        self.num_prompt = data.num_prompt_tokens
        self.computed = data.num_computed_tokens
        self.tables = {group: list(table) for group, table in data.block_tables.items()}
        self.items = list(data.mm_items)


class FakeRunner:
    """The runner's bookkeeping without tensors, asserting the scheduler's promises."""

    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None):
        self.sched = sched
        self.config = sched.config
        self.script = script or {}
        self.states: dict[str, _State] = {}
        self.encoder_outputs: dict[str, int] = {}  # identifier -> number of vectors
        self.encode_counts: Counter[str] = Counter()
        self.outputs: list[str] = []  # every request id ever sampled for, in order
        self.deltas: dict[str, list[RequestDelta]] = {}
        self.shared = False  # more than one request in the engine as the step was scheduled

    def step(self) -> tuple[SchedulerOutput, list[RequestDelta]]:
        self.shared = len(self.sched.running) + len(self.sched.waiting) > 1
        out = self.sched.schedule()
        result = self.execute(out)
        deltas = self.sched.update_from_output(out, result)
        for delta in deltas:
            self.deltas.setdefault(delta.request_id, []).append(delta)
        self.check_accounting()
        return out, deltas

    def run(self, max_steps: int = 1000) -> int:
        for steps in range(1, max_steps + 1):
            self.step()
            if not self.sched.has_work():
                return steps
        raise AssertionError(f"still busy after {max_steps} steps: {self.sched.running} {list(self.sched.waiting)}")

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        config = self.config
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        assert len(self.sched.running) <= config.max_num_seqs

        # Same order as the real runner: forget, evict, then add and update.
        for request_id in out.dropped_request_ids:
            self.states.pop(request_id, None)
        for identifier in out.evicted_encoder_identifiers:
            assert identifier in self.encoder_outputs, f"evicted {identifier} that was never encoded"
            del self.encoder_outputs[identifier]
        for data in out.new_requests:
            assert data.request_id not in self.states, f"{data.request_id} sent as new twice"
            if not config.enable_prefix_caching:
                assert data.num_computed_tokens == 0
            # A prefix hit is whole blocks and always leaves the last token to compute.
            assert data.num_computed_tokens % config.block_size == 0
            assert data.num_computed_tokens < len(data.token_ids)
            self.states[data.request_id] = _State(data)
        for data in out.cached_requests:
            state = self.states[data.request_id]
            assert data.num_computed_tokens == state.computed
            for group, new in data.new_block_ids.items():
                state.tables[group].extend(new)
        sent = {d.request_id for d in out.new_requests} | {d.request_id for d in out.cached_requests}
        assert sent == set(out.num_scheduled_tokens)

        encoded_now: set[str] = set()
        for request_id, indices in out.scheduled_encoder_inputs.items():
            assert request_id in out.num_scheduled_tokens
            for index in indices:
                item = self.states[request_id].items[index]
                assert item.identifier not in encoded_now, f"{item.identifier} scheduled twice in one step"
                assert item.identifier not in self.encoder_outputs, f"{item.identifier} re-encoded while resident"
                encoded_now.add(item.identifier)
                self.encode_counts[item.identifier] += 1
                self.encoder_outputs[item.identifier] = item.length

        owners: dict[int, str] = {}
        result = RunnerOutput()
        long_chunks: list[tuple[int, int, list]] = []  # (start, end, items) of chunks the bound covers
        for request_id, num_new in out.num_scheduled_tokens.items():
            state = self.states[request_id]
            assert num_new >= 1
            start, end = state.computed, state.computed + num_new
            assert end <= len(state.token_ids)
            short = not state.items and len(state.token_ids) <= config.short_prefill_tokens
            if len(state.token_ids) - start > 1 and not short:
                long_chunks.append((start, end, state.items))
            self._check_tables(request_id, state, start, end)
            # The scheduler's tables: the runner's keep entries a window gave back (never read).
            for table in self.sched.kv.tables(request_id).values():
                for block in table:
                    if block == FREED:
                        continue
                    assert 0 <= block < config.num_kv_blocks
                    if not config.enable_prefix_caching:  # with it, full prefix blocks are shared
                        assert block not in owners, f"block {block} held by {owners.get(block)} and {request_id}"
                    owners[block] = request_id
            for item in state.items:
                if item.offset < end and item.end > start:
                    assert item.identifier in self.encoder_outputs, (
                        f"{request_id} computes [{start}, {end}) over {item.identifier} without its output"
                    )
                    if config.disable_chunked_mm_input:
                        assert start <= item.offset and item.end <= end, (
                            f"{request_id} splits {item.identifier} [{item.offset}, {item.end}) at [{start}, {end})"
                        )
            state.computed = end
            if end == len(state.token_ids):
                script = self.script.get(request_id, [])
                index = len(state.token_ids) - state.num_prompt
                token = script[index] if index < len(script) else FILLER
                state.token_ids.append(token)
                result.sampled_token_ids[request_id] = token
                self.outputs.append(request_id)
        self._check_long_prefill_bound(long_chunks)
        return result

    def _check_long_prefill_bound(self, long_chunks: list[tuple[int, int, list]]) -> None:
        """D119: while the engine is shared, a step's long prefill chunks take at most the
        bound together; past it only a lone first chunk that must take an item whole."""
        bound = self.config.long_prefill_step_tokens
        if not bound or not self.shared:
            return
        total = sum(end - start for start, end, _ in long_chunks)
        if total <= bound:
            return
        assert self.config.disable_chunked_mm_input and len(long_chunks) == 1, (
            f"long prefill chunks of {total} tokens in a shared step, bound {bound}: {long_chunks}")
        start, end, items = long_chunks[0]
        assert any(item.offset <= start < item.end == end for item in items), (
            f"a chunk [{start}, {end}) past the bound {bound} takes no item whole")

    def _check_tables(self, request_id: str, state: _State, start: int, end: int) -> None:
        """Every group's table is the scheduler's, the same in the runner: a full-attention
        table covers the chunk; a window table too, every block the chunk's queries can read
        (from its first query's window on) held and the ones before given back; a cross table
        is whole from the first chunk on (its request's encoder tokens), unchanged."""
        size = self.config.block_size
        held = self.sched.kv.tables(request_id)
        request = self.sched.requests[request_id]
        assert set(state.tables) == set(held) == {group.index for group in self.config.kv_cache.groups}
        for group in self.config.kv_cache.groups:
            table, ours = state.tables[group.index], held[group.index]
            if isinstance(group.kind, CrossAttention):
                assert table == ours and len(table) == blocks_needed(request.num_cross_tokens, size)
                continue
            if isinstance(group.kind, RecurrentState):  # the state's pages, whatever the length
                assert table == ours and len(table) == group.blocks_per_request
                continue
            assert len(table) == len(ours) == blocks_needed(end, size)
            first = first_visible_block(start, group.window, size) if isinstance(group.kind, SlidingWindow) else 0
            assert FREED not in table[first:]
            assert table[first:] == ours[first:]
            assert all(block == FREED for block in ours[:first])  # dead for the window: given back

    def check_accounting(self) -> None:
        kv = self.sched.kv
        live = [r.request_id for r in self.sched.running] + [r.request_id for r in self.sched.waiting]
        held_by_group = []
        for group in self.config.kv_cache.groups:
            tables = [kv.tables(request_id)[group.index] for request_id in live]
            for table in tables:
                live_blocks = [block for block in table if block != FREED]
                assert len(set(live_blocks)) == len(live_blocks)  # a request never holds a block twice
            held_by_group.append({block for table in tables for block in table if block != FREED}
                                 # recurrent-state snapshots, until their requests' next step
                                 | kv.pending_state_pages().get(group.index, set()))
        for first, other in ((a, b) for a in held_by_group for b in held_by_group if a is not b):
            assert not first & other, "a block held by two KV groups"
        held = set().union(*held_by_group)  # shared prefix blocks count once
        assert kv.num_free_blocks + len(held) == self.config.num_kv_blocks
        for blocks, stats in zip(held_by_group, kv.group_stats()):
            assert stats["used_blocks"] == len(blocks)
        for request in self.sched.waiting:  # a waiting request holds nothing
            assert not any(kv.tables(request.request_id).values())
        # The scheduler's resident set is what the runner holds; every slot is free or used by one.
        cache = self.sched.encoder_cache
        for identifier in self.encoder_outputs:
            assert cache.is_resident(identifier)
        assert cache.num_free_slots + sum(self.encoder_outputs.values()) == cache.cache_size
        assert cache.num_free_slots <= cache.num_freeable_slots <= cache.cache_size

    def output_tokens(self, request_id: str) -> list[int]:
        return [t for delta in self.deltas.get(request_id, []) for t in delta.new_token_ids]

    def finish_reason(self, request_id: str) -> FinishReason | None:
        deltas = self.deltas.get(request_id, [])
        return deltas[-1].finish_reason if deltas else None


def chunk_ranges(runner: FakeRunner, out: SchedulerOutput, request_id: str) -> tuple[int, int]:
    end = runner.states[request_id].computed
    return end - out.num_scheduled_tokens[request_id], end


