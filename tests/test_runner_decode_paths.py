"""A decode step's Python in the runner: what it keeps between steps instead of redoing it
per token (positions given ahead, the plain-argmax rows, the item walks a decode past its
items skips) must give what the full work gives."""

from __future__ import annotations

import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.runner import sampler
from vlmd.runner.batch import POSITIONS_AHEAD, build_batch
from vlmd.runner.model_runner import encoder_spans
from vlmd.runner.request_state import RunnerRequestState, is_plain_greedy
from vlmd.types import MultiModalItem, SamplingParams


def _state(name, prompt, computed, family_state=None, sampling=None, mm_items=()):
    return RunnerRequestState(
        request_id=name, token_ids=list(range(1, computed + 2)), num_prompt_tokens=prompt, mm_items=list(mm_items),
        sampling=sampling or SamplingParams(max_tokens=500, temperature=0), block_tables={0: list(range(40))},
        num_computed_tokens=computed, stop_token_ids=(), family_state=family_state,
    )


class _CountingPositions:
    """A stand-in model's ``slice_positions``: 3 rows, past the prompt shifted by a delta per
    row (as M-RoPE's), counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, family_state, start, end, num_prompt_tokens):
        self.calls += 1
        if family_state is None:
            return None
        index = torch.arange(start, end)
        return torch.stack([index + family_state, index + 2 * family_state, index + 3 * family_state])


def test_decode_positions_come_from_a_run_given_ahead_and_equal_the_models():
    backend = attention_backend_for("cpu", 16, "torch")
    positions = _CountingPositions()
    shifted, plain = _state("m", 10, 10, family_state=-4), _state("p", 10, 10)
    steps = 150
    for _ in range(steps):
        batch = build_batch([(shifted, 1), (plain, 1)], backend, positions)
        start = shifted.num_computed_tokens
        assert batch.positions.tolist() == [[start - 4, start], [start - 8, start], [start - 12, start]]
        for state in (shifted, plain):
            state.token_ids.append(0)
            state.num_computed_tokens += 1
    # Once per POSITIONS_AHEAD decodes and request, not once per step.
    runs = -(-steps // POSITIONS_AHEAD)
    assert positions.calls == 2 * runs


def test_a_prefill_chunk_still_asks_the_model_for_its_own_positions():
    backend = attention_backend_for("cpu", 16, "torch")
    positions = _CountingPositions()
    state = _state("m", 10, 0, family_state=5)
    batch = build_batch([(state, 10)], backend, positions)
    assert batch.positions[0].tolist() == list(range(5, 15)) and positions.calls == 1
    assert state.positions_ahead is None


def test_plain_greedy_is_only_a_request_no_processor_touches():
    assert is_plain_greedy(SamplingParams(temperature=0), (2,))
    assert not is_plain_greedy(SamplingParams(temperature=0.7), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, logprobs=0), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, repetition_penalty=1.2), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, logit_bias=((3, 5.0),)), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, suppress_token_ids=(1,)), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, begin_suppress_token_ids=(1,)), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, allowed_token_ids=(1, 2)), ())
    assert not is_plain_greedy(SamplingParams(temperature=0, min_tokens=3, max_tokens=5), (2,))
    assert is_plain_greedy(SamplingParams(temperature=0, min_tokens=3, max_tokens=5), ())


def test_plain_greedy_rows_take_the_argmax_without_the_processors(monkeypatch):
    logits = torch.randn(3, 50)
    plain = [_state(f"r{i}", 4, 4) for i in range(3)]
    assert all(state.plain_greedy for state in plain)  # derived from its sampling
    full = [_state("x", 4, 4) for _ in range(3)]
    for state in full:
        state.plain_greedy = False
    expected, _ = sampler.sample(logits.clone(), full, torch.Generator())

    def refuse(*_):
        raise AssertionError("a processor ran for plain greedy rows")

    monkeypatch.setattr(sampler, "apply_token_constraints", refuse)
    tokens, logprobs = sampler.sample(logits.clone(), plain, torch.Generator())
    assert tokens == expected == logits.argmax(dim=-1).tolist()
    assert logprobs == [None, None, None]
    # One row that is not plain: the whole batch takes the processors.
    plain[1].plain_greedy = False
    monkeypatch.undo()
    tokens, _ = sampler.sample(logits.clone(), plain, torch.Generator())
    assert tokens == expected


class _Untouchable(list):
    """A request's items that a decode past them must not walk."""

    def __iter__(self):
        raise AssertionError("a decode past every item walked the items")


def test_a_decode_past_its_items_does_not_walk_them():
    backend = attention_backend_for("cpu", 16, "torch")
    item = MultiModalItem("image", "x" * 16, offset=2, length=4)
    past = _state("p", 10, 10, mm_items=[item])
    assert past.items_end == 6
    past.mm_items = _Untouchable([item])
    batch = build_batch([(past, 1)], backend)
    assert encoder_spans(batch, {}) == []
    # Before its items' end the walk still finds the item's rows.
    within = _state("w", 10, 0, mm_items=[item])
    features = torch.arange(8.0).view(4, 2)
    spans = encoder_spans(build_batch([(within, 10)], backend), {item.identifier: features})
    assert [(row, rows.tolist()) for row, rows in spans] == [(2, features.tolist())]
