"""Each logits processor of the sampler equals its transformers counterpart on the same
inputs, batched over rows with different parameters; OpenAI's presence and frequency
penalties equal their published definition. Torch only, no server."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlmd.runner.logits_processors import apply_logit_bias, apply_penalties, warp
from vlmd.runner.request_state import RunnerRequestState
from vlmd.runner.sampler import sample
from vlmd.types import SamplingParams

VOCAB = 50


def _state(sampling: SamplingParams, prompt: list[int], output: list[int] = (), request_id: str = "r"):
    state = RunnerRequestState(
        request_id=request_id, token_ids=list(prompt), num_prompt_tokens=len(prompt), mm_items=[],
        sampling=sampling, block_tables={0: []}, num_computed_tokens=0, stop_token_ids=(),
    )
    for token in output:
        state.append_token(token)
    return state


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _histories():
    return [([1, 2, 3, 3], [4, 4, 5]), ([7, 8], [9]), ([10, 11, 12], [12, 12, 12, 60]), ([2], [])]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty):
    logits = _logits(4)
    states = []
    expected = []
    for row, (prompt, output) in enumerate(_histories()):
        # Before the history is counted: the counts are built once, then kept up to date.
        state = _state(SamplingParams(repetition_penalty=penalty), prompt, request_id=f"r{row}")
        state.token_counts_for(VOCAB)
        for token in output:
            state.append_token(token)
        states.append(state)
        ids = torch.tensor([[t for t in prompt + output if t < VOCAB]])
        expected.append(RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone()))
    ours = logits.clone()
    apply_penalties(ours, states)
    torch.testing.assert_close(ours, torch.cat(expected), rtol=0, atol=0)


def test_presence_and_frequency_follow_openais_definition_over_the_output_only():
    logits = _logits(4, seed=1)
    params = [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.7), (2.0, -2.0)]
    states = [
        _state(SamplingParams(presence_penalty=p, frequency_penalty=f), prompt, output, f"r{row}")
        for row, ((prompt, output), (p, f)) in enumerate(zip(_histories(), params))
    ]
    ours = logits.clone()
    apply_penalties(ours, states)
    expected = logits.clone()
    for row, ((_, output), (presence, frequency)) in enumerate(zip(_histories(), params)):
        for token in set(output):
            if token < VOCAB:  # mu[j] -> mu[j] - c[j] * frequency - (c[j] > 0) * presence
                expected[row, token] -= output.count(token) * frequency + presence
    torch.testing.assert_close(ours, expected)


def test_all_penalties_together_apply_repetition_first():
    logits = _logits(1, seed=2)
    prompt, output = [1, 2], [2, 3, 3]
    state = _state(SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2), prompt, output)
    ours = logits.clone()
    apply_penalties(ours, [state])
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits.clone())
    expected[0, 2] -= 0.3 + 0.2
    expected[0, 3] -= 0.3 + 0.4
    torch.testing.assert_close(ours, expected)


def test_logit_bias_equals_transformers_sequence_bias():
    logits = _logits(3, seed=3)
    biases = [((3, 5.0), (7, -100.0)), (), ((0, 1.5),)]
    states = [_state(SamplingParams(logit_bias=b), [1], request_id=f"r{i}") for i, b in enumerate(biases)]
    ours = logits.clone()
    apply_logit_bias(ours, states)
    for row, bias in enumerate(biases):
        expected = logits[row : row + 1].clone()
        if bias:
            processor = SequenceBiasLogitsProcessor([[[token], value] for token, value in bias])
            expected = processor(torch.tensor([[1]]), expected)
        torch.testing.assert_close(ours[row : row + 1], expected)


@pytest.mark.parametrize(
    "params",
    [
        [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_k=0), dict(temperature=1.0, top_k=1)],
        [dict(temperature=1.0, top_p=0.9), dict(temperature=0.5, top_p=0.3), dict(temperature=2.0)],
        [dict(temperature=1.0, min_p=0.1), dict(temperature=0.8, min_p=0.5), dict(temperature=1.0, min_p=0.0)],
        [dict(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05), dict(temperature=1.1, top_k=3, min_p=0.2)],
    ],
)
def test_warpers_equal_transformers_chain(params):
    logits = _logits(len(params), seed=4)
    sampling = [SamplingParams(**p) for p in params]
    ours = warp(logits.clone(), sampling)
    for row, p in enumerate(sampling):
        scores = logits[row : row + 1].clone()
        ids = torch.tensor([[0]])
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
        if p.top_k:
            scores = TopKLogitsWarper(p.top_k)(ids, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(p.top_p)(ids, scores)
        if p.min_p:
            scores = MinPLogitsWarper(p.min_p)(ids, scores)
        torch.testing.assert_close(ours[row : row + 1], scores.softmax(dim=-1))


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.5])  # peaked: top 256 suffice; wider; flat: a full sort
def test_top_p_over_a_large_vocabulary_equals_transformers(scale):
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(5)) * scale
    sampling = [SamplingParams(top_p=p) for p in (0.9, 0.5, 0.99)]
    ours = warp(logits.clone(), sampling)
    for row, p in enumerate(sampling):
        expected = TopPLogitsWarper(p.top_p)(torch.tensor([[0]]), logits[row : row + 1].clone()).softmax(dim=-1)
        assert torch.equal(ours[row] > 0, expected[0] > 0)
        torch.testing.assert_close(ours[row : row + 1], expected)


def test_draws_follow_the_distribution_and_never_pick_a_masked_token():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0]]).repeat(4000, 1)
    states = [_state(SamplingParams(temperature=1.0), [1], request_id=f"r{i}") for i in range(4000)]
    from vlmd.runner.sampler import _draw

    tokens = _draw(probs, states, torch.Generator().manual_seed(0))
    assert set(tokens) == {1, 3}
    assert abs(tokens.count(3) / 4000 - 0.8) < 0.03


def test_min_p_removes_tokens_below_the_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = warp(logits, [SamplingParams(min_p=0.35)])
    assert probs[0, 2] == 0 and probs[0, 3] == 0  # 0.15 < 0.35 * 0.5
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))


def test_greedy_rows_see_bias_and_penalties_and_seeded_rows_are_batch_independent():
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 2.0
    logits[:, 9] = 1.0
    greedy_bias = _state(SamplingParams(temperature=0, logit_bias=((9, 5.0),)), [1], request_id="a")
    greedy_penalty = _state(SamplingParams(temperature=0, frequency_penalty=2.0), [1], [4], request_id="b")
    seeded = _state(SamplingParams(temperature=1.0, seed=11), [1], request_id="c")
    tokens, _ = sample(logits.clone(), [greedy_bias, greedy_penalty, seeded], torch.Generator().manual_seed(0))
    alone, _ = sample(logits[:1].clone(), [seeded], torch.Generator().manual_seed(99))
    assert tokens[:2] == [9, 9]
    assert tokens[2] == alone[0]


def test_counts_are_rebuilt_from_kept_tokens_after_preemption():
    """A preempted request comes back with its outputs in token_ids: the counts match."""
    state = _state(SamplingParams(frequency_penalty=1.0), [1, 2], [5, 5, 6])
    counts = state.token_counts_for(VOCAB)
    assert counts.output[5] == 2 and counts.output[6] == 1 and counts.seen[1] and not counts.seen[3]
    state.append_token(5)
    assert counts.output[5] == 3
    assert math.isclose(float(counts.output.sum()), 4)


NAN, INF = float("nan"), float("inf")


def _poisoned(rows: int, poison: dict[int, float]) -> torch.Tensor:
    """Finite logits with one value of each poisoned row replaced (NaN, +inf) or, for -inf,
    the whole row (nothing finite left)."""
    logits = _logits(rows)
    for row, value in poison.items():
        if value == -INF:
            logits[row] = -INF
        else:
            logits[row, 7] = value
    return logits


KINDS = {  # fault injection: each kind of request, alone in a plain-greedy batch or beside the others
    "greedy": SamplingParams(temperature=0),
    "greedy-biased": SamplingParams(temperature=0, logit_bias=((3, 1.0),)),
    "sampled": SamplingParams(temperature=0.8),
    "seeded": SamplingParams(temperature=0.8, seed=5),
    "logprobs": SamplingParams(temperature=0, logprobs=2),
    "sampled-logprobs": SamplingParams(temperature=1.0, logprobs=0),
}


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_that_is_not_finite_is_refused_by_name_before_any_state_advances(kind, value):
    from vlmd.runner.sampler import NonFiniteLogits

    states = [_state(KINDS[name], [1, 2], request_id=name) for name in KINDS]
    poisoned_row = list(KINDS).index(kind)
    with pytest.raises(NonFiniteLogits) as refused:
        sample(_poisoned(len(states), {poisoned_row: value}), states, torch.Generator().manual_seed(0))
    assert refused.value.request_ids == [kind]
    assert kind in str(refused.value) and "not finite" in str(refused.value)
    assert all(state.token_ids == [1, 2] for state in states)  # nothing was chosen for anyone
    # Alone (a plain-greedy request takes the argmax shortcut): refused too, never a token.
    with pytest.raises(NonFiniteLogits) as alone:
        sample(_poisoned(1, {0: value}), [_state(KINDS[kind], [1], request_id=kind)], torch.Generator())
    assert alone.value.request_ids == [kind]


def test_every_poisoned_row_is_named_and_finite_rows_with_masked_tokens_are_not():
    from vlmd.runner.sampler import NonFiniteLogits

    states = [_state(KINDS["sampled"], [1], request_id=f"r{row}") for row in range(4)]
    logits = _poisoned(4, {1: NAN, 3: INF})
    logits[0, :40] = -INF  # a mask leaves finite values: a good row
    with pytest.raises(NonFiniteLogits) as refused:
        sample(logits.clone(), states, torch.Generator())
    assert refused.value.request_ids == ["r1", "r3"]
    good = _poisoned(2, {})
    good[0, :40] = -INF
    tokens, _ = sample(good, states[:2], torch.Generator().manual_seed(0))
    assert 40 <= tokens[0] < VOCAB and 0 <= tokens[1] < VOCAB


def test_a_draw_with_no_mass_left_is_refused_not_answered_past_the_vocabulary():
    from vlmd.runner.sampler import NonFiniteLogits, _draw

    probs = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 0.0], [NAN, 0.5, 0.5]])
    states = [_state(KINDS["sampled"], [1], request_id=f"r{row}") for row in range(3)]
    with pytest.raises(NonFiniteLogits) as refused:
        _draw(probs, states, torch.Generator().manual_seed(0))
    assert refused.value.request_ids == ["r1", "r2"]
    assert _draw(probs[:1], states[:1], torch.Generator().manual_seed(0))[0] in (1, 2)
