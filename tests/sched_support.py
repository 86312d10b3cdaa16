"""The scheduler driven without tensors: a fake runner that checks every promise.

Shared by the scheduler, prefix-cache and encoder-decoder scheduling tests.
"""

from __future__ import annotations

from collections import Counter


from vlmd.sched.kv_groups import FREED, first_visible_block
from vlmd.sched.block_pool import blocks_needed
from vlmd.sched.output import RunnerOutput, SchedulerOutput
from vlmd.sched.scheduler import Scheduler, SchedulerConfig
from vlmd.types import EngineRequest, FinishReason, MultiModalItem, RequestDelta, SamplingParams

EOS = 2
FILLER = 7  # what the fake runner samples when a request has no script


def make_scheduler(**overrides) -> Scheduler:
    config = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=512,
        block_size=4,
        num_kv_blocks=128,
        max_num_encoder_input_tokens=64,
        encoder_cache_size=64,
        # Most tests reuse the same token ids across requests; prefix caching has its own tests.
        enable_prefix_caching=False,
    )
    config.update(overrides)
    if "max_model_len" not in overrides and config["block_size"] > 0:
        # A small test cache also bounds the context: the config rejects a cache that
        # cannot hold one max_model_len sequence.
        config["max_model_len"] = min(512, config["num_kv_blocks"] * config["block_size"])
    return Scheduler(SchedulerConfig(**config))


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
        self.blocks = list(data.block_ids)
        self.windows = {window: list(table) for window, table in data.window_block_ids.items()}
        self.items = list(data.mm_items)
        self.cross = list(data.cross_block_ids)


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

    def step(self) -> tuple[SchedulerOutput, list[RequestDelta]]:
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
            state.blocks.extend(data.new_block_ids)
            for window, new in data.new_window_block_ids.items():
                state.windows[window].extend(new)
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
        for request_id, num_new in out.num_scheduled_tokens.items():
            state = self.states[request_id]
            assert num_new >= 1
            start, end = state.computed, state.computed + num_new
            assert end <= len(state.token_ids)
            assert len(state.blocks) == blocks_needed(end, config.block_size)
            assert state.blocks == self.sched.kv.block_ids(request_id)
            for block in state.blocks:
                assert 0 <= block < config.num_kv_blocks
                if not config.enable_prefix_caching:  # with it, full prefix blocks are shared
                    assert block not in owners, f"block {block} held by {owners.get(block)} and {request_id}"
                owners[block] = request_id
            self._check_window_tables(request_id, state, start, end)
            self._check_cross_table(request_id, state)
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
        return result

    def _check_window_tables(self, request_id: str, state: _State, start: int, end: int) -> None:
        """Each window table covers the chunk, and every block the chunk's queries can read
        (from its first query's window on) is held, the same in the runner and the scheduler."""
        size = self.config.block_size
        held = self.sched.kv.window_block_ids(request_id)
        assert set(state.windows) == {group.window for group in self.config.window_groups}
        for group in self.config.window_groups:
            table, ours = state.windows[group.window], held[group.window]
            assert len(table) == len(ours) == blocks_needed(end, size)
            first = first_visible_block(start, group.window, size)
            assert all(block != FREED and 0 <= block < group.num_blocks for block in table[first:])
            assert table[first:] == ours[first:]
            assert all(block == FREED for block in ours[:first])  # dead for the window: given back

    def _check_cross_table(self, request_id: str, state: _State) -> None:
        """A scheduled request holds its whole cross table from its first chunk on, unchanged."""
        kv = self.sched.kv
        assert state.cross == kv.cross_block_ids(request_id)
        if kv.cross is not None:
            assert len(state.cross) == kv.cross_blocks_needed(self.sched.requests[request_id])
            assert all(0 <= block < self.config.cross_kv_blocks for block in state.cross)

    def check_accounting(self) -> None:
        kv = self.sched.kv
        live = [r.request_id for r in self.sched.running] + [r.request_id for r in self.sched.waiting]
        tables = [kv.block_ids(request_id) for request_id in live]
        for table in tables:
            assert len(set(table)) == len(table)  # a request never holds a block twice
        held = {block for table in tables for block in table}  # shared prefix blocks count once
        assert kv.num_free_blocks + len(held) == self.config.num_kv_blocks
        for group, stats in zip(self.config.window_groups, kv.window_stats()):
            tables = [kv.window_block_ids(request_id)[group.window] for request_id in live]
            held = {block for table in tables for block in table if block != FREED}
            assert stats["used_blocks"] == len(held) <= group.num_blocks
        if kv.cross is not None:
            # Running requests hold whole cross tables, never shared; waiting ones hold none.
            tables = [kv.cross_block_ids(request.request_id) for request in self.sched.running]
            held = [block for table in tables for block in table]
            assert len(set(held)) == len(held)
            assert all(not kv.cross_block_ids(request.request_id) for request in self.sched.waiting)
            assert kv.cross_stats()["used_blocks"] == len(held) == self.config.cross_kv_blocks - kv.cross.num_free_blocks
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


