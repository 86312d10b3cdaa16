"""The scheduler on its own, without torch: requests in, SchedulerOutputs out, RunnerOutputs back.

``FakeRunner`` (tests/sched_support.py) keeps the same per-request bookkeeping as the real runner (token ids, computed
count, block table, resident encoder outputs) from nothing but the SchedulerOutputs, and checks
the protocol on every step: budgets, block tables of exactly ceil(tokens / block_size), encoder
outputs present for every placeholder a chunk touches, no output encoded twice while resident.
It samples a token for each request whose chunk reached its last token, as the runner does.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from vlmd.sched.kv_spec import FullAttention, RecurrentState
from vlmd.sched.output import RunnerOutput
from vlmd.sched.request import RequestStatus
from vlmd.types import FinishReason, TokenLogprob

from sched_support import (
    EOS,
    FILLER,
    FakeRunner,
    chunk_ranges,
    image,
    make_request,
    make_scheduler,
)


# ---- layering -------------------------------------------------------------------------


def test_scheduler_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import vlmd.sched.scheduler, vlmd.sched.kv_manager, vlmd.sched.block_pool\n"
        "import vlmd.sched.encoder_cache, vlmd.sched.output, vlmd.sched.request, vlmd.types\n"
        "assert 'torch' not in sys.modules, 'vlmd.sched pulled in torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_config_rejects_non_positive_sizes():
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
        with pytest.raises(ValueError, match=name):
            make_scheduler(**{name: 0})


# ---- continuous batching ---------------------------------------------------------------


def test_empty_scheduler_schedules_nothing():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and not sched.has_work()


def test_new_request_joins_the_running_batch():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 10))
    out, deltas = runner.step()
    assert out.num_scheduled_tokens == {"a": 10} and [d.request_id for d in deltas] == ["a"]
    runner.step()

    sched.add_request(make_request("b", 6))
    out, deltas = runner.step()
    # a decodes one token while b prefills, in one batch; a stays a cached request.
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    assert [d.request_id for d in out.cached_requests] == ["a"]
    assert [d.request_id for d in out.new_requests] == ["b"]
    assert {d.request_id for d in deltas} == {"a", "b"}
    assert sched.num_running == 2 and sched.num_waiting == 0


def test_decodes_are_scheduled_before_waiting_prefills():
    sched = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 5))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 4, "b": 5}
    sched.add_request(make_request("c", 30))
    out, _ = runner.step()
    # Both decodes first, in admission order, then c gets what is left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 8)]
    out, _ = runner.step()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 8)]


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4, max_tokens=2))
    sched.add_request(make_request("b", 4, max_tokens=5))
    sched.add_request(make_request("c", 4, max_tokens=1))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert sched.num_running == 2 and sched.num_waiting == 1
    out, deltas = runner.step()  # a samples its second and last token
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [d.finish_reason for d in deltas if d.request_id == "a"] == [FinishReason.LENGTH]
    out, _ = runner.step()
    assert "a" in out.dropped_request_ids
    assert list(out.num_scheduled_tokens) == ["b", "c"]
    runner.run()


# ---- token budget and chunked prefill -------------------------------------------------


def test_long_prompt_is_chunked_and_sampled_after_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 50, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, deltas = runner.step()
        chunks.append(out.num_scheduled_tokens["a"])
        assert deltas == [] and runner.outputs == []
        assert sched.requests["a"].num_output_tokens == 0
    out, deltas = runner.step()
    chunks.append(out.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 16, 2]
    assert [d.new_token_ids for d in deltas] == [[FILLER]]
    assert deltas[0].num_prompt_tokens == 50
    out, deltas = runner.step()
    assert out.num_scheduled_tokens == {"a": 1}
    assert deltas[0].finish_reason is FinishReason.LENGTH


def test_token_budget_holds_under_a_mixed_load():
    sched = make_scheduler(max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=40, encoder_cache_size=40,
                           max_num_encoder_input_tokens=24)
    runner = FakeRunner(sched)
    for i in range(12):
        items = (image(f"img{i % 3}", 3, 12),) if i % 2 else ()
        sched.add_request(make_request(f"r{i}", 5 + 7 * (i % 5) + (15 if items else 0), items=items, max_tokens=1 + i % 6))
    runner.run()
    for i in range(12):
        assert len(runner.output_tokens(f"r{i}")) == 1 + i % 6
        assert runner.finish_reason(f"r{i}") is FinishReason.LENGTH
    assert runner.encode_counts == {"img0": 1, "img1": 1, "img2": 1}
    assert sched.kv.num_free_blocks == 40
    assert sched.encoder_cache.num_freeable_slots == 40
    assert sched.requests == {}


@pytest.mark.parametrize("seed", range(9))
def test_random_load_with_preemption_and_aborts_keeps_every_promise(seed):
    """Arrivals over time, images shared and repeated, tight KV and encoder caches, aborts.

    The FakeRunner checks every step; at the end every request has finished with exactly the
    tokens it was due and every block and encoder slot is free again.
    """
    rng = random.Random(seed)
    budget = rng.choice([8, 16, 32])
    disable_chunked_mm_input = seed % 3 == 0
    # As the engine builder guarantees: every item fits the encoder budget and cache, and in one
    # step when it may not be split; the KV cache holds max_model_len tokens.
    max_item = min(12, budget) if disable_chunked_mm_input else 12
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=rng.choice([2, 4, 6]), max_model_len=96,
                           block_size=4, num_kv_blocks=24, max_num_encoder_input_tokens=16, encoder_cache_size=32,
                           disable_chunked_mm_input=disable_chunked_mm_input,
                           short_prefill_tokens=12 if seed % 2 else 0,
                           # D119's bound (FakeRunner checks it every step), below the largest item on some
                           long_prefill_step_tokens=(0, 5, 9)[seed // 3])
    runner = FakeRunner(sched)
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    for step in range(1000):
        if step < 60 and rng.random() < 0.4:
            request_id = f"r{step}"
            num_prompt = rng.randint(1, 40)
            items, cursor = [], rng.randint(0, 4)
            while cursor + max_item <= num_prompt and rng.random() < 0.7:
                length = rng.randint(2, max_item)
                # Ids repeat across and within prompts; one id means one length, as in real use.
                identifier = rng.randint(0, 9)
                items.append(image(f"img{identifier}-{length}", cursor, length))
                cursor += length + rng.randint(0, 6)
            max_tokens = rng.randint(1, 96 - num_prompt)
            sched.add_request(make_request(request_id, num_prompt, items=tuple(items), max_tokens=max_tokens))
            expected[request_id] = max_tokens
        # Aborts only while requests arrive, so that they cannot hide a request that is stuck.
        if step < 60 and rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            assert sched.abort_requests([victim])[0].finish_reason is FinishReason.ABORT
            aborted.add(victim)
        runner.step()
        if step >= 60 and not sched.has_work():
            break
    assert not sched.has_work(), f"stuck: {sched.running} {list(sched.waiting)}"
    assert sched.num_preemptions > 0  # the KV cache is tight enough to preempt
    for request_id, max_tokens in expected.items():
        if request_id not in aborted:
            assert len(runner.output_tokens(request_id)) == max_tokens, request_id
            assert runner.finish_reason(request_id) is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 24
    assert sched.encoder_cache.num_freeable_slots == 32
    assert sched.requests == {}


# ---- short prompts first (D110) ---------------------------------------------------------


def test_a_short_prompt_runs_with_the_decodes_alone_and_the_long_prefill_resumes_next_step():
    sched = make_scheduler(max_num_batched_tokens=16, short_prefill_tokens=6)
    runner = FakeRunner(sched)
    sched.add_request(make_request("d", 4, max_tokens=20))
    runner.step()
    sched.add_request(make_request("long", 40, items=(image("img", 2, 10),), max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"d": 1, "long": 15} and out.scheduled_encoder_inputs == {"long": [0]}
    sched.add_request(make_request("short", 5, max_tokens=4))
    out, deltas = runner.step()
    assert out.num_scheduled_tokens == {"d": 1, "short": 5}  # no long chunk, no encoder work
    assert out.scheduled_encoder_inputs == {}
    assert "short" in {delta.request_id for delta in deltas if delta.new_token_ids}  # its first token, now
    sched.add_request(make_request("short2", 5, max_tokens=4))
    out, _ = runner.step()  # never two short steps in a row: the long prefill goes on, and its
    # chunk leaves the decode after it (short's) its token
    assert out.num_scheduled_tokens == {"d": 1, "long": 14, "short": 1}
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"d": 1, "short": 1, "short2": 5}
    runner.run()


def test_short_prompts_go_ahead_of_longer_waiting_ones_and_only_when_enabled():
    for short_prefill_tokens, first_step in ((6, {"short": 4}), (0, {"long": 12, "short": 4})):
        sched = make_scheduler(max_num_batched_tokens=16, short_prefill_tokens=short_prefill_tokens)
        runner = FakeRunner(sched)
        sched.add_request(make_request("long", 12))
        sched.add_request(make_request("short", 4))
        out, _ = runner.step()
        assert out.num_scheduled_tokens == first_step
        assert [request.request_id for request in sched.running] == list(first_step)
        runner.run()
        assert runner.finish_reason("long") is runner.finish_reason("short") is FinishReason.LENGTH


def test_a_prompt_with_an_item_is_never_short():
    sched = make_scheduler(max_num_batched_tokens=16, short_prefill_tokens=6)
    runner = FakeRunner(sched)
    sched.add_request(make_request("long", 12))
    sched.add_request(make_request("tiny-image", 4, items=(image("img", 1, 2),)))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"long": 12, "tiny-image": 4}


# ---- long prefills share a step's bound while the engine is shared (D119) ---------------


def _a_decode_then_two_long_prompts(long_prefill_step_tokens: int) -> FakeRunner:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_step_tokens=long_prefill_step_tokens)
    runner = FakeRunner(sched)
    sched.add_request(make_request("d", 4, max_tokens=20))
    runner.step()
    sched.add_request(make_request("a", 30, max_tokens=2))
    sched.add_request(make_request("b", 30, max_tokens=2))
    return runner


def test_two_long_prompts_beside_a_decode_take_the_bound_together():
    runner = _a_decode_then_two_long_prompts(8)
    steps = [runner.step()[0].num_scheduled_tokens for _ in range(5)]
    assert steps == [{"d": 1, "a": 8}, {"d": 1, "a": 8}, {"d": 1, "a": 8},
                     {"d": 1, "a": 6, "b": 2},  # a's last 6, then b takes what the bound leaves
                     {"d": 1, "a": 1, "b": 8}]  # a decodes: outside the bound
    runner.run()
    assert runner.finish_reason("a") is runner.finish_reason("b") is FinishReason.LENGTH


def test_without_the_bound_long_prompts_take_the_whole_budget():
    out, _ = _a_decode_then_two_long_prompts(0).step()
    assert out.num_scheduled_tokens == {"d": 1, "a": 30, "b": 30}


def test_a_lone_long_prompt_keeps_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_step_tokens=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 40, max_tokens=2))
    chunks = [runner.step()[0].num_scheduled_tokens for _ in range(3)]
    assert chunks == [{"a": 16}, {"a": 16}, {"a": 8}]
    # Once another request is in the engine, the bound holds from the next step on.
    sched.add_request(make_request("b", 40, max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    runner.run()


def test_decodes_and_short_prompts_are_outside_the_bound():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_seqs=16, short_prefill_tokens=10,
                           long_prefill_step_tokens=4)
    runner = FakeRunner(sched)
    for index in range(6):
        sched.add_request(make_request(f"d{index}", 5, max_tokens=30))
    out, _ = runner.step()  # six short prompts: 30 tokens in one step
    assert out.num_scheduled_tokens == {f"d{index}": 5 for index in range(6)}
    runner.step()  # decodes alone: the next short prompt may have a short step
    sched.add_request(make_request("long", 40, max_tokens=2))
    sched.add_request(make_request("short", 10, max_tokens=2))
    out, _ = runner.step()  # a short step: the decodes and the short prompt, whole
    assert out.num_scheduled_tokens == {**{f"d{index}": 1 for index in range(6)}, "short": 10}
    out, _ = runner.step()  # six decodes and short's: 7 tokens, past the bound; long takes the bound
    assert out.num_scheduled_tokens == {**{f"d{index}": 1 for index in range(6)}, "short": 1, "long": 4}
    sched.add_request(make_request("short2", 10, max_tokens=2))
    out, _ = runner.step()  # a short step
    assert out.num_scheduled_tokens["short2"] == 10 and "long" not in out.num_scheduled_tokens
    # Never two short steps in a row: short3 is admitted in a step with long's chunk, whole.
    sched.add_request(make_request("short3", 10, max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens["long"] == 4 and out.num_scheduled_tokens["short3"] == 10
    runner.run()


def test_a_prefix_hit_is_not_counted_against_the_bound():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_step_tokens=8, enable_prefix_caching=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("first", 40, max_tokens=1))
    runner.run()
    sched.add_request(make_request("d", 4, max_tokens=20))
    runner.step()
    second = make_request("second", 44, max_tokens=1)  # the first's 40 tokens, then 4 more
    sched.add_request(second)
    out, deltas = runner.step()
    (data,) = out.new_requests
    assert data.num_computed_tokens == 40 and out.num_scheduled_tokens == {"d": 1, "second": 4}
    assert "second" in {delta.request_id for delta in deltas}  # its whole prompt, in one step
    runner.run()


def test_every_request_finishes_under_the_bound_while_short_prompts_keep_coming():
    """No starvation: short prompts arriving every step (each taking a short step of its own
    every other step), a decode and five long prompts with images; the long prompts still get
    the bound every other step, so the loop ends within its count of steps."""
    sched = make_scheduler(max_num_batched_tokens=32, max_num_seqs=16, short_prefill_tokens=6,
                           long_prefill_step_tokens=8, num_kv_blocks=256, max_num_encoder_input_tokens=16,
                           encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("d", 4, max_tokens=200))
    for index in range(5):
        sched.add_request(make_request(f"long{index}", 40, items=(image(f"img{index}", 5, 16),), max_tokens=3))
    first_tokens: dict[str, int] = {}
    for step in range(120):
        if step < 100:
            sched.add_request(make_request(f"s{step}", 4, max_tokens=1))
        _, deltas = runner.step()
        for delta in deltas:
            first_tokens.setdefault(delta.request_id, step)
    # 200 long prompt tokens at 8 a step, every other step: 50 steps; their first tokens by then.
    assert all(first_tokens.get(f"long{index}", 999) <= 52 for index in range(5)), first_tokens
    runner.run()
    for index in range(5):
        assert len(runner.output_tokens(f"long{index}")) == 3
    assert all(len(runner.output_tokens(f"s{step}")) == 1 for step in range(100))


def test_an_item_longer_than_the_bound_goes_whole_when_items_are_not_split():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_step_tokens=4, disable_chunked_mm_input=True,
                           encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("d", 4, max_tokens=30))
    runner.step()
    sched.add_request(make_request("a", 30, items=(image("x", 2, 20),), max_tokens=2))
    sched.add_request(make_request("b", 30, items=(image("y", 0, 20),), max_tokens=2))
    chunks = [(chunk_ranges(runner, out, "a") if "a" in out.num_scheduled_tokens else None,
               out.num_scheduled_tokens.get("b"))
              for out, _ in (runner.step() for _ in range(5))]
    # a: the text before its item, then the item whole (past the bound: the step's first long
    # chunk), then the bound; b's item waits for a step with no long chunk before it (a's
    # decode is none).
    assert chunks == [((0, 2), None), ((2, 22), None), ((22, 26), None), ((26, 30), None), ((30, 31), 20)]
    runner.run()
    assert runner.finish_reason("a") is runner.finish_reason("b") is FinishReason.LENGTH
    assert runner.encode_counts == {"x": 1, "y": 1}


def test_chunks_under_the_bound_still_end_at_recurrent_snapshots():
    sched = make_scheduler(layers=(FullAttention(), RecurrentState(250)), slot_bytes=100, enable_prefix_caching=True,
                           num_kv_blocks=80, max_model_len=64, long_prefill_step_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("d", 4, max_tokens=40))
    runner.step()
    # Placeholders [3, 14): snapshots at 12 and 28 of 30 tokens (D105).
    sched.add_request(make_request("a", 30, items=(image("img", 3, 11),), max_tokens=2))
    chunks = []
    for _ in range(5):
        out, _ = runner.step()
        chunks.append((chunk_ranges(runner, out, "a"), bool(out.state_snapshots.get("a"))))
    assert chunks == [((0, 8), False), ((8, 12), True), ((12, 20), False), ((20, 28), True), ((28, 30), False)]
    runner.run()


def test_the_bound_must_not_be_negative():
    with pytest.raises(ValueError, match="long_prefill_step_tokens"):
        make_scheduler(long_prefill_step_tokens=-1)


# ---- multimodal items ----------------------------------------------------------------


def test_image_split_across_steps_is_encoded_once_and_released_after_its_last_placeholder():
    sched = make_scheduler(max_num_batched_tokens=8, encoder_cache_size=32, max_num_encoder_input_tokens=32)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 28, items=(image("img", 4, 20),), max_tokens=1))
    request = sched.requests["a"]

    out, _ = runner.step()  # [0, 8): text, then the first 4 placeholders
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert request.held_encoder_items == {"img"}
    for expected_end in (16, 24):
        out, _ = runner.step()
        assert chunk_ranges(runner, out, "a") == (expected_end - 8, expected_end)
        assert out.scheduled_encoder_inputs == {}
    # [16, 24) computed the last placeholder: the reference is dropped, the output stays resident.
    assert request.held_encoder_items == set()
    assert sched.encoder_cache.is_resident("img")
    assert sched.encoder_cache.num_freeable_slots == 32
    out, deltas = runner.step()
    assert chunk_ranges(runner, out, "a") == (24, 28) and deltas[0].finish_reason is FinishReason.LENGTH
    assert runner.encode_counts == {"img": 1}


def test_reference_is_kept_while_placeholders_remain():
    sched = make_scheduler(max_num_batched_tokens=8, encoder_cache_size=32, max_num_encoder_input_tokens=32)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 28, items=(image("img", 4, 20),), max_tokens=1))
    runner.step()
    runner.step()
    assert sched.encoder_cache.num_freeable_slots == 12  # 20 slots held by a
    assert not sched.encoder_cache.can_allocate(13, encoder_budget=32, pending_tokens=0)


def test_short_encoder_budget_cuts_the_chunk_just_before_the_item():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("x", 2, 16),), max_tokens=1))
    sched.add_request(make_request("b", 20, items=(image("y", 3, 16),), max_tokens=1))
    out, _ = runner.step()
    # a used the step's whole encoder budget: b computes its text up to the image only.
    assert out.num_scheduled_tokens == {"a": 20, "b": 3}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"b": 17}
    assert out.scheduled_encoder_inputs == {"b": [0]}
    runner.run()
    assert runner.encode_counts == {"x": 1, "y": 1}


def test_full_encoder_cache_cuts_the_chunk_and_evicts_once_released():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=64, encoder_cache_size=24)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("x", 2, 16),), max_tokens=3))
    sched.add_request(make_request("b", 20, items=(image("y", 5, 16),), max_tokens=1))
    out, _ = runner.step()
    # x holds 16 of 24 slots until a's chunk is done: y does not fit, b stops before it.
    assert out.num_scheduled_tokens == {"a": 20, "b": 5}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    out, _ = runner.step()
    # a finished with x; evicting it makes room for y.
    assert out.evicted_encoder_identifiers == ["x"]
    assert out.scheduled_encoder_inputs == {"b": [0]}
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    runner.run()


def test_an_image_that_cannot_be_encoded_at_the_prompt_start_holds_the_queue():
    # b's image starts its prompt: with no encoder budget left, b is not admitted, and c behind
    # it waits too (first come, first served).
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 18, items=(image("x", 0, 16),), max_tokens=1))
    sched.add_request(make_request("b", 18, items=(image("y", 0, 16),), max_tokens=1))
    sched.add_request(make_request("c", 4, max_tokens=1))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 18}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    runner.run()


def test_disable_chunked_mm_input_never_splits_an_item():
    def chunks(disable: bool) -> list[tuple[int, int]]:
        sched = make_scheduler(max_num_batched_tokens=10, disable_chunked_mm_input=disable)
        runner = FakeRunner(sched)
        sched.add_request(make_request("a", 16, items=(image("img", 4, 8),), max_tokens=1))
        ranges = []
        while sched.has_work():
            out, _ = runner.step()
            ranges.append(chunk_ranges(runner, out, "a"))
        return ranges

    assert chunks(False) == [(0, 10), (10, 16)]
    ranges = chunks(True)
    assert ranges == [(0, 4), (4, 14), (14, 16)]
    for start, end in ranges:
        assert not (start < 4 < end < 12) and not (4 < start < 12)


def test_disable_chunked_mm_input_keeps_a_resident_item_whole():
    # b's image was already encoded for a; being resident must not let b's chunk split it.
    sched = make_scheduler(max_num_batched_tokens=10, disable_chunked_mm_input=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, items=(image("img", 0, 8),), max_tokens=1))
    runner.step()
    assert sched.encoder_cache.is_resident("img")
    sched.add_request(make_request("b", 14, items=(image("img", 4, 8),), max_tokens=1))
    ranges = []
    while sched.has_work():
        out, _ = runner.step()
        if "b" in out.num_scheduled_tokens:
            ranges.append(chunk_ranges(runner, out, "b"))
    assert ranges == [(0, 4), (4, 14)]
    assert runner.encode_counts == {"img": 1}


def test_disable_chunked_mm_input_keeps_a_repeated_image_whole():
    # After the first occurrence the output is still held for the second; that must not let
    # the second one be split.
    sched = make_scheduler(max_num_batched_tokens=8, disable_chunked_mm_input=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("img", 0, 8), image("img", 10, 8)), max_tokens=1))
    ranges = []
    while sched.has_work():
        out, _ = runner.step()
        ranges.append(chunk_ranges(runner, out, "a"))
    assert ranges == [(0, 8), (8, 10), (10, 18), (18, 20)]
    assert runner.encode_counts == {"img": 1}


def test_encoder_indices_refer_to_items_in_prompt_order():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 30, items=(image("late", 20, 6), image("early", 2, 6)), max_tokens=1))
    out, _ = runner.step()
    assert [item.identifier for item in out.new_requests[0].mm_items] == ["early", "late"]
    assert out.scheduled_encoder_inputs == {"a": [0, 1]}


def test_same_image_twice_in_one_chunk_is_encoded_once():
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=64, encoder_cache_size=64)
    runner = FakeRunner(sched)
    items = (image("img", 2, 10), image("img", 14, 10))
    sched.add_request(make_request("a", 26, items=items, max_tokens=1))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 26}
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert sched.encoder_cache.num_free_slots == 54
    assert not sched.has_work()
    assert sched.encoder_cache.num_freeable_slots == 64
    assert runner.encode_counts == {"img": 1}


def test_same_image_twice_in_one_chunk_uses_the_encoder_budget_once():
    # Only one output is computed, so only 10 tokens of encoder budget are spent.
    sched = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=10, encoder_cache_size=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 26, items=(image("img", 2, 10), image("img", 14, 10)), max_tokens=1))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 26}


def test_same_image_twice_across_chunks_is_held_until_its_last_use():
    sched = make_scheduler(max_num_batched_tokens=12, encoder_cache_size=32, max_num_encoder_input_tokens=32)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 30, items=(image("img", 2, 8), image("img", 20, 8)), max_tokens=1))
    request = sched.requests["a"]
    out, _ = runner.step()  # [0, 12): first occurrence, encoded
    assert out.scheduled_encoder_inputs == {"a": [0]}
    runner.step()  # [12, 24): into the second occurrence
    assert request.held_encoder_items == {"img"}
    runner.step()  # [24, 30): past it
    assert not sched.has_work()
    assert runner.encode_counts == {"img": 1}
    assert sched.encoder_cache.num_freeable_slots == 32


def test_image_shared_across_requests_is_encoded_once():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("img", 2, 16),), max_tokens=4))
    sched.add_request(make_request("b", 20, items=(image("img", 3, 16),), max_tokens=4))
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert out.num_scheduled_tokens == {"a": 20, "b": 20}
    sched.add_request(make_request("c", 20, items=(image("img", 0, 16),), max_tokens=1))
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {}
    assert out.num_scheduled_tokens["c"] == 20
    runner.run()
    assert runner.encode_counts == {"img": 1}
    assert sched.encoder_cache.num_hits == 2


def test_waiting_request_does_not_pin_encoder_outputs():
    """A waiting request that cannot get KV blocks must not keep encoder slots from running ones.

    Otherwise b (running, needs room for y) waits for c to release x, and c (waiting) waits
    for b's KV blocks: neither ever moves.
    """
    sched = make_scheduler(
        max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=16, num_kv_blocks=12
    )
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 17, items=(image("x", 0, 16),), max_tokens=1))
    sched.add_request(make_request("b", 37, items=(image("y", 20, 16),), max_tokens=1))
    sched.add_request(make_request("c", 30, items=(image("x", 0, 16),), max_tokens=1))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 17, "b": 20}  # c does not fit in the KV cache yet
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.requests["c"].held_encoder_items == set()
    runner.run(max_steps=20)
    assert runner.finish_reason("b") is FinishReason.LENGTH
    assert runner.finish_reason("c") is FinishReason.LENGTH
    assert sched.kv.num_free_blocks == 12


# ---- KV blocks, preemption, abort ----------------------------------------------------


def test_blocks_follow_the_token_count_and_are_freed_on_finish():
    sched = make_scheduler(block_size=4, num_kv_blocks=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 10, max_tokens=5))
    expected = []
    for _ in range(5):
        runner.step()  # the FakeRunner checks len(table) == ceil(computed / 4) itself
        expected.append(len(sched.kv.tables("a")[0]))
    # computed after each step: 10, 11, 12, 13, 14 (the fifth sample ends it)
    assert expected[:4] == [3, 3, 3, 4]
    assert sched.kv.tables("a")[0] == [] and sched.kv.num_free_blocks == 16
    out = sched.schedule()
    assert out.dropped_request_ids == ["a"] and out.is_empty


def test_preemption_drops_the_most_recently_admitted_request_and_resumes_it():
    sched = make_scheduler(block_size=4, num_kv_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched, script={"b": [51, 52, 53, 54]})
    sched.add_request(make_request("a", 7, max_tokens=4))
    sched.add_request(make_request("b", 7, max_tokens=4))
    sched.add_request(make_request("c", 3, max_tokens=1))
    runner.step()  # a, b: 7 tokens, 2 blocks each; c waits for a slot
    runner.step()  # 8 computed each: still 2 blocks
    assert sched.kv.num_free_blocks == 0

    out, _ = runner.step()  # a needs a third block: b goes
    assert out.dropped_request_ids == ["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.new_requests == []  # nothing is admitted in a step that preempted
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # ahead of c
    assert sched.kv.tables("b")[0] == [] and sched.kv.num_free_blocks == 1
    assert "b" not in runner.states

    out, deltas = runner.step()  # a: fourth token, finished
    assert deltas[0].finish_reason is FinishReason.LENGTH
    assert out.num_scheduled_tokens == {"a": 1}  # b needs 3 blocks, 1 is free
    out, deltas = runner.step()
    assert out.dropped_request_ids == ["a"]
    # a's slot and blocks went back: b first (front of the queue), then c.
    assert [d.request_id for d in out.new_requests] == ["b", "c"]
    resumed = out.new_requests[0]
    assert resumed.token_ids == [100 + i for i in range(7)] + [51, 52]
    assert resumed.num_prompt_tokens == 7 and resumed.num_computed_tokens == 0
    assert out.num_scheduled_tokens["b"] == 9
    # b's deltas go on from its third token: nothing re-sent, nothing lost.
    assert [d.new_token_ids for d in deltas if d.request_id == "b"] == [[53]]
    runner.run()
    assert runner.output_tokens("b") == [51, 52, 53, 54]
    assert sched.kv.num_free_blocks == 4


def test_the_latest_admitted_request_is_the_one_preempted():
    sched = make_scheduler(block_size=4, num_kv_blocks=6, max_num_seqs=3)
    runner = FakeRunner(sched)
    for request_id in "abc":
        sched.add_request(make_request(request_id, 7, max_tokens=4))
    runner.step()
    runner.step()  # 8 tokens each: two blocks each, none free
    out, _ = runner.step()  # a needs a third block: c goes (not b); b gets one of c's
    assert out.dropped_request_ids == ["c"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.request_id for r in sched.running] == ["a", "b"]
    runner.run()
    assert all(len(runner.output_tokens(request_id)) == 4 for request_id in "abc")


def test_the_latest_request_preempts_itself_rather_than_an_earlier_one():
    sched = make_scheduler(block_size=4, num_kv_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 7, max_tokens=4))
    sched.add_request(make_request("b", 8, max_tokens=3))
    runner.step()  # two blocks each
    out, _ = runner.step()  # a's 8th token fits its blocks; b's 9th needs a third: b gives way
    assert out.dropped_request_ids == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b"]
    runner.run()
    assert len(runner.output_tokens("a")) == 4 and len(runner.output_tokens("b")) == 3


def test_preemption_releases_encoder_references():
    sched = make_scheduler(block_size=4, num_kv_blocks=6, max_num_seqs=2, max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, max_tokens=10))
    sched.add_request(make_request("b", 20, items=(image("img", 4, 12),), max_tokens=2))
    runner.step()  # a's prompt takes the whole budget
    out, _ = runner.step()  # a decodes, b computes [0, 7) and encodes img
    assert out.num_scheduled_tokens == {"a": 1, "b": 7} and out.scheduled_encoder_inputs == {"b": [0]}
    b = sched.requests["b"]
    assert b.held_encoder_items == {"img"}
    assert sched.encoder_cache.num_freeable_slots == 64 - 12

    out, _ = runner.step()  # b's next chunk needs two blocks, one is free: b, the latest, goes
    assert out.dropped_request_ids == ["b"] and list(out.num_scheduled_tokens) == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.held_encoder_items == set()
    assert sched.encoder_cache.num_freeable_slots == 64
    assert sched.encoder_cache.is_resident("img")  # kept for when b comes back

    runner.run()
    assert len(runner.output_tokens("b")) == 2
    assert runner.encode_counts == {"img": 1}  # b found its output still resident
    assert sched.encoder_cache.num_freeable_slots == 64
    assert sched.kv.num_free_blocks == 6


def test_abort_frees_blocks_of_waiting_and_running_requests():
    sched = make_scheduler(block_size=4, num_kv_blocks=8, max_num_seqs=1, max_num_batched_tokens=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("run", 20, items=(image("img", 4, 12),)))
    sched.add_request(make_request("wait", 4))
    runner.step()  # run: first chunk of 8 (2 blocks), holding img
    assert sched.kv.num_free_blocks == 6
    assert sched.encoder_cache.num_freeable_slots == 52
    deltas = sched.abort_requests(["run", "wait", "unknown"])
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [
        ("run", [], FinishReason.ABORT),
        ("wait", [], FinishReason.ABORT),
    ]
    assert sched.kv.num_free_blocks == 8
    assert sched.encoder_cache.num_freeable_slots == 64
    assert not sched.has_work() and sched.requests == {}
    assert sched.abort_requests(["run"]) == []
    out = sched.schedule()
    assert set(out.dropped_request_ids) == {"run", "wait"} and out.is_empty


def test_abort_between_schedule_and_update_ignores_the_result():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    sched.abort_requests(["a"])
    assert sched.update_from_output(out, RunnerOutput(sampled_token_ids={"a": 5})) == []
    assert sched.kv.num_free_blocks == sched.config.num_kv_blocks


def test_add_request_rejects_a_prompt_that_can_never_fit():
    sched = make_scheduler(block_size=4, num_kv_blocks=4)
    sched.add_request(make_request("fits", 15))  # 15 + 1 sampled = 16 = 4 blocks = max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("too-long", 16))
    assert "too-long" not in sched.requests
    assert [r.request_id for r in sched.waiting] == ["fits"]


# ---- stop conditions -----------------------------------------------------------------


def run_one(script: list[int], max_model_len: int = 512, num_prompt: int = 4, **sampling) -> tuple[list[int], FinishReason]:
    sched = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(sched, script={"a": script})
    sched.add_request(make_request("a", num_prompt, **sampling))
    runner.run()
    assert sched.kv.num_free_blocks == sched.config.num_kv_blocks
    return runner.output_tokens("a"), runner.finish_reason("a")


def test_eos_stops():
    assert run_one([5, 6, EOS, 8]) == ([5, 6, EOS], FinishReason.STOP)


def test_ignore_eos_runs_to_max_tokens():
    assert run_one([EOS, EOS, EOS, EOS], max_tokens=3, ignore_eos=True) == ([EOS, EOS, EOS], FinishReason.LENGTH)


def test_ignore_eos_leaves_eos_out_of_the_stop_ids_sent_to_the_runner():
    sched = make_scheduler()
    sched.add_request(make_request("plain", 4, stop_token_ids=(9,)))
    sched.add_request(make_request("ignoring", 4, stop_token_ids=(9,), ignore_eos=True))
    out = sched.schedule()
    stop_ids = {d.request_id: d.stop_token_ids for d in out.new_requests}
    assert set(stop_ids["plain"]) == {EOS, 9} and stop_ids["ignoring"] == (9,)


def test_stop_token_ids_stop():
    assert run_one([5, 9, 6], stop_token_ids=(9,)) == ([5, 9], FinishReason.STOP)
    assert run_one([5, 9, 6], stop_token_ids=(9,), ignore_eos=True) == ([5, 9], FinishReason.STOP)


def test_max_tokens_stops():
    assert run_one([], max_tokens=3) == ([FILLER] * 3, FinishReason.LENGTH)
    assert run_one([EOS], max_tokens=1) == ([EOS], FinishReason.STOP)  # eos wins over length


def test_min_tokens_defers_eos_and_stop_ids():
    assert run_one([EOS, 9, EOS, 5], min_tokens=3, stop_token_ids=(9,)) == ([EOS, 9, EOS], FinishReason.STOP)
    assert run_one([EOS, EOS], min_tokens=2) == ([EOS, EOS], FinishReason.STOP)
    assert run_one([EOS, 5, 6], min_tokens=2, max_tokens=3) == ([EOS, 5, 6], FinishReason.LENGTH)


def test_max_model_len_stops():
    assert run_one([], max_model_len=12, num_prompt=10, max_tokens=16) == ([FILLER] * 2, FinishReason.LENGTH)


def test_finishing_delta_carries_prompt_size_and_logprobs():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=1))
    out = sched.schedule()
    logprob = TokenLogprob(token_id=5, logprob=-0.5, top=[(5, -0.5)])
    (delta,) = sched.update_from_output(out, RunnerOutput(sampled_token_ids={"a": 5}, logprobs={"a": logprob}))
    assert delta.new_token_ids == [5] and delta.logprobs == [logprob]
    assert delta.num_prompt_tokens == 4 and delta.finish_reason is FinishReason.LENGTH


def test_a_blocked_head_of_queue_is_not_counted_again_at_every_retry():
    # "b" waits for KV blocks for several steps while its image is resident; its lookup
    # counts once, when it is finally admitted.
    sched = make_scheduler(block_size=4, num_kv_blocks=10, max_model_len=40)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, items=(image("img", 2, 8),), max_tokens=20))
    runner.step()
    sched.add_request(make_request("b", 20, items=(image("img", 2, 8),), max_tokens=1))
    for _ in range(3):
        runner.step()
    assert "b" in [r.request_id for r in sched.waiting]  # a holds most blocks
    runner.run()
    cache = sched.encoder_cache
    assert (cache.num_queries, cache.num_hits) == (2, 1)  # a's miss; b's hit, at admission


def test_a_refused_grammar_ends_its_request_alone_with_a_client_error():
    """The runner reports a request whose grammar refused its sampled token: that request ends
    with a 400-class error and frees its blocks; the other one in the step gets its token."""
    sched = make_scheduler()
    sched.add_request(make_request("bad", 4))
    sched.add_request(make_request("good", 4))
    out = sched.schedule()
    result = RunnerOutput(sampled_token_ids={"good": 5}, grammar_rejected={"bad": "the grammar refused token 9"})
    deltas = {d.request_id: d for d in sched.update_from_output(out, result)}
    assert deltas["bad"].finish_reason is FinishReason.ERROR and deltas["bad"].error_status == 400
    assert deltas["bad"].new_token_ids == [] and "refused" in deltas["bad"].error
    assert deltas["good"].new_token_ids == [5] and deltas["good"].finish_reason is None
    assert set(sched.requests) == {"good"} and "bad" in sched.schedule().dropped_request_ids
