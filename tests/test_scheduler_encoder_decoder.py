"""The scheduler with encoder-decoder requests (Whisper): an item without placeholders.

Such an item sits at offset 0 with length 0 and ``encoder_tokens`` vectors of encoder output.
Its contract: it is encoded (or found resident) in the chunk that covers its offset, counts
``encoder_tokens`` against the encoder budget and cache, and is released once the request has
computed past its offset, because the runner keeps what it derived (cross-attention K/V).
"""

from __future__ import annotations

import random

import pytest

from sched_support import FakeRunner, image, make_request, make_scheduler
from vlmd.types import MultiModalItem


def audio(identifier: str, encoder_tokens: int = 15, offset: int = 0) -> MultiModalItem:
    return MultiModalItem(modality="audio", identifier=identifier, offset=offset, length=0,
                          encoder_tokens=encoder_tokens)


class EncoderDecoderRunner(FakeRunner):
    """FakeRunner that also checks items without placeholders.

    When a chunk covers such an item's offset, its output must be resident; the runner then
    derives the request's cross state from it. Every later chunk of that request needs the
    cross state (kept across steps, dropped with the request, rebuilt after preemption).
    """

    def __init__(self, sched, script=None):
        super().__init__(sched, script)
        self.cross_state: dict[str, str] = {}  # request id -> identifier it was derived from
        self.derivations = 0

    def execute(self, out):
        starts = {data.request_id: data.num_computed_tokens for data in out.new_requests + out.cached_requests}
        for request_id in out.dropped_request_ids:
            self.cross_state.pop(request_id, None)
        result = super().execute(out)
        for request_id, num_new in out.num_scheduled_tokens.items():
            start, end = starts[request_id], starts[request_id] + num_new
            for item in self.states[request_id].items:
                # As the runner does: at the chunk covering its offset, or at the first chunk
                # after a prefix hit past it (the request has no cross state yet).
                if item.length == 0 and item.offset < end and (start <= item.offset or request_id not in self.cross_state):
                    assert item.identifier in self.encoder_outputs, f"{request_id}: no output for {item.identifier}"
                    self.cross_state[request_id] = item.identifier
                    self.derivations += 1
            if any(item.length == 0 for item in self.states[request_id].items):
                assert request_id in self.cross_state, f"{request_id} runs [{start}, {end}) without cross state"
        for identifier in self.encoder_outputs:  # the parent counts placeholders; these count vectors
            self.encoder_outputs[identifier] = self._encoder_tokens(identifier)
        return result

    def _encoder_tokens(self, identifier: str) -> int:
        for state in self.states.values():
            for item in state.items:
                if item.identifier == identifier:
                    return item.num_encoder_tokens
        return self.encoder_outputs[identifier]


def test_audio_is_encoded_in_the_first_chunk_and_released_after_it():
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=20)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=4))
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"a": [0]} and out.num_scheduled_tokens == {"a": 2}
    request = sched.requests["a"]
    assert request.held_encoder_items == set()  # released: the runner keeps cross K/V instead
    assert sched.encoder_cache.num_freeable_slots == 20 and sched.encoder_cache.is_resident("x")
    runner.run()
    assert runner.output_tokens("a") == [7, 7, 7, 7] and runner.encode_counts["x"] == 1


def test_chunked_prefill_encodes_once_at_the_first_chunk():
    sched = make_scheduler(max_num_batched_tokens=4, max_num_encoder_input_tokens=20, encoder_cache_size=20)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 10, items=(audio("x"),), max_tokens=2))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_encoder_inputs == {"a": [0]}
    assert sched.requests["a"].held_encoder_items == set()
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_encoder_inputs == {}
    runner.run()
    assert runner.derivations == 1


def test_encoder_tokens_count_against_the_budget_although_there_are_no_placeholders():
    # 15 vectors each, 20 per step: the second request waits for the next step.
    sched = make_scheduler(max_num_encoder_input_tokens=20, encoder_cache_size=40)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=3))
    sched.add_request(make_request("b", 2, items=(audio("y"),), max_tokens=3))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 2} and [r.request_id for r in sched.waiting] == ["b"]
    out, _ = runner.step()
    assert out.scheduled_encoder_inputs == {"b": [0]} and out.num_scheduled_tokens == {"a": 1, "b": 2}
    runner.run()


def test_the_encoder_cache_evicts_released_audio_for_new_audio():
    # Room for one output: after a's first chunk its output is unused and may be evicted.
    sched = make_scheduler(max_num_encoder_input_tokens=15, encoder_cache_size=15)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=5))
    sched.add_request(make_request("b", 2, items=(audio("y"),), max_tokens=5))
    runner.step()
    out, _ = runner.step()
    assert out.evicted_encoder_identifiers == ["x"] and out.scheduled_encoder_inputs == {"b": [0]}
    runner.run()
    assert runner.output_tokens("a") == runner.output_tokens("b") == [7] * 5


def test_the_same_audio_in_many_requests_is_encoded_once():
    sched = make_scheduler(max_num_encoder_input_tokens=15, encoder_cache_size=15)
    runner = EncoderDecoderRunner(sched)
    for name in "abcd":
        sched.add_request(make_request(name, 2, items=(audio("same"),), max_tokens=3))
    out, _ = runner.step()
    assert out.num_scheduled_tokens == dict.fromkeys("abcd", 2)
    runner.run()
    assert runner.encode_counts["same"] == 1 and runner.derivations == 4


def test_an_audio_output_larger_than_the_encoder_budget_is_refused_at_once():
    sched = make_scheduler(max_num_encoder_input_tokens=10, encoder_cache_size=64)
    with pytest.raises(ValueError, match="item of 15 tokens exceeds the encoder budget of 10"):
        sched.add_request(make_request("a", 2, items=(audio("x"),)))
    # No placeholders: a step budget smaller than the output is no obstacle, even unchunked.
    sched = make_scheduler(max_num_batched_tokens=8, max_num_encoder_input_tokens=20, encoder_cache_size=20,
                           disable_chunked_mm_input=True)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("a", 2, items=(audio("x"),), max_tokens=2))
    runner.run()


def test_a_preempted_transcription_rebuilds_its_cross_state():
    # 6 blocks of 4 tokens: three requests that grow to 10 tokens (3 blocks) cannot all stay.
    sched = make_scheduler(num_kv_blocks=6, max_num_encoder_input_tokens=30, encoder_cache_size=30)
    runner = EncoderDecoderRunner(sched)
    for name, identifier in (("a", "x"), ("b", "y"), ("c", "x")):
        sched.add_request(make_request(name, 2, items=(audio(identifier),), max_tokens=8))
    runner.run()
    assert sched.num_preemptions > 0
    assert runner.derivations == 3 + sched.num_preemptions  # every restart derived its cross state again
    for name in "abc":
        assert runner.output_tokens(name) == [7] * 8


def test_bounded_chunks_encode_a_requests_items_together_with_the_first():
    """D119 beside a decode: a prompt with two items without placeholders at offset 0 (as
    Llama 3.2 Vision's images) goes 4 tokens a step; its first chunk encodes both together
    (the encoder budget is not the bound's), and every later chunk has the cross state."""
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_step_tokens=4, max_num_encoder_input_tokens=30,
                           encoder_cache_size=30)
    runner = EncoderDecoderRunner(sched)
    sched.add_request(make_request("d", 2, items=(audio("x"),), max_tokens=12))
    runner.step()
    sched.add_request(make_request("v", 14, items=(audio("p", 10), audio("q", 10)),
                                   max_tokens=2))
    steps = [runner.step()[0] for _ in range(4)]
    assert [out.num_scheduled_tokens.get("v") for out in steps] == [4, 4, 4, 2]
    assert [out.scheduled_encoder_inputs.get("v") for out in steps] == [[0, 1], None, None, None]
    runner.run()
    assert runner.output_tokens("v") == [7, 7]


@pytest.mark.parametrize("seed", range(12))
def test_random_mixes_of_transcriptions_and_image_chats(seed):
    rng = random.Random(seed)
    budget = rng.choice([4, 8, 32])
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=rng.choice([2, 4, 8]), num_kv_blocks=48,
                           max_num_encoder_input_tokens=max(budget, 15), encoder_cache_size=rng.choice([15, 30, 60]),
                           long_prefill_step_tokens=(0, 3)[seed % 2])  # D119's bound on every other seed
    runner = EncoderDecoderRunner(sched)
    expected = {}
    for index in range(10):
        name = f"r{index}"
        max_tokens = rng.randint(1, 6)
        if rng.random() < 0.6:
            which = rng.randint(0, 3)  # the same audio always has the same output size
            items = (audio(f"a{which}", encoder_tokens=(10, 15)[which % 2]),)
            request = make_request(name, rng.randint(1, 12), items=items, max_tokens=max_tokens)
        else:
            which = rng.randint(0, 3)
            items = (image(f"i{which}", 1, 2 + 2 * which),)
            request = make_request(name, 12, items=items, max_tokens=max_tokens)
        sched.add_request(request)
        expected[name] = max_tokens
        if rng.random() < 0.3:
            runner.step()
    runner.run()
    for name, max_tokens in expected.items():
        assert runner.output_tokens(name) == [7] * max_tokens
    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.encoder_cache.num_freeable_slots == sched.encoder_cache.cache_size
