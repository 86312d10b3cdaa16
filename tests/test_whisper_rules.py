"""Whisper's token rules on their own: timestamp rules against transformers' processor,
suppression in the sampler, segment splitting, and quiet-point windows."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from vlmd.processing.audio_windows import split_at_quiet_points
from vlmd.runner.request_state import is_plain_greedy
from vlmd.types import SamplingParams
from vlmd_whisper.timestamps import TimestampRules

VOCAB, EOS, SOT, NO_TIMESTAMPS = 400, 250, 251, 259  # timestamps: 260..399
GENERATION = {"no_timestamps_token_id": NO_TIMESTAMPS, "eos_token_id": EOS, "decoder_start_token_id": SOT,
              "max_initial_timestamp_index": 50}


@dataclass
class _State:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0))
    stop_token_ids: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def masks_stop_tokens(self) -> bool:
        return False

    @property
    def plain_greedy(self) -> bool:  # as RunnerRequestState derives it
        return is_plain_greedy(self.sampling, self.stop_token_ids)


def _history(rng: random.Random) -> list[int]:
    """Output tokens that follow the rules' grammar loosely (text, timestamps, pairs)."""
    tokens, time = [], 260
    for _ in range(rng.randint(0, 12)):
        if rng.random() < 0.4:
            time = min(399, time + rng.randint(0, 20))
            tokens.append(time)
        else:
            tokens.append(rng.randrange(0, EOS))
    return tokens


@pytest.mark.parametrize("seed", range(20))
def test_timestamp_rules_equal_transformers(seed):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    rng = random.Random(seed)
    prompt = [SOT]  # an English-only model's timestamp prompt
    histories = [_history(rng) for _ in range(6)]
    length = max(len(h) for h in histories)
    histories = [h + [rng.randrange(0, EOS)] * (length - len(h)) for h in histories]  # equal lengths, as in a batch
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(histories), VOCAB, generator=generator) * 3
    logits[:, 260:] -= rng.choice([0.0, 2.0, 6.0])  # timestamps more or less likely than text

    config = GenerationConfig(**GENERATION)
    reference = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))
    input_ids = torch.tensor([prompt + h for h in histories])
    expected = reference(input_ids, logits.clone())

    rules = TimestampRules.from_generation_config(GENERATION)
    states = [_State(prompt + h, len(prompt)) for h in histories]
    ours = rules.apply(logits.clone(), states)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert torch.equal(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_rules_only_apply_to_prompts_that_ask_for_timestamps():
    rules = TimestampRules.from_generation_config(GENERATION)
    logits = torch.zeros(2, VOCAB)
    rules.apply(logits, [_State([SOT, NO_TIMESTAMPS], 2), _State([SOT], 1)])
    assert not torch.isinf(logits[0]).any()
    assert torch.isinf(logits[1, :260]).all()  # the first token is a timestamp
    multilingual = TimestampRules.from_generation_config(
        {**GENERATION, "is_multilingual": True, "task_to_id": {"transcribe": 255, "translate": 254}}
    )
    assert not multilingual.predicts_timestamps([SOT], 1)  # language detection
    assert multilingual.predicts_timestamps([SOT, 252, 255], 3)


def test_sampler_applies_suppression_then_the_model_rule():
    from vlmd.runner.sampler import sample

    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 10
    logits[:, 6] = 9
    logits[:, 7] = 8
    states = [
        _State([SOT, NO_TIMESTAMPS], 2, SamplingParams(temperature=0, suppress_token_ids=(5,))),
        _State([SOT, NO_TIMESTAMPS], 2, SamplingParams(temperature=0, begin_suppress_token_ids=(5, 6))),
        _State([SOT, NO_TIMESTAMPS, 9], 2, SamplingParams(temperature=0, begin_suppress_token_ids=(5, 6))),
    ]
    tokens, _ = sample(logits.clone(), states, torch.Generator())
    assert tokens == [6, 7, 5]  # begin suppression only before the first output token
    allowed = [_State([SOT], 1, SamplingParams(temperature=0, allowed_token_ids=(7, 300)))]
    seen = []
    tokens, _ = sample(logits[:1].clone(), allowed, torch.Generator(), lambda l, s: seen.append(l.clone()) or l)
    assert tokens == [7] and torch.isinf(seen[0][0, 5])


def test_segments_split_at_timestamp_pairs(tiny_whisper_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.processing.base import ProcessingContext
    from vlmd_whisper.processing import WhisperAudioProcessor, WhisperProcessingInfo

    ctx = ProcessingContext(str(tiny_whisper_dir), "tiny", AutoConfig.from_pretrained(tiny_whisper_dir),
                            AutoTokenizer.from_pretrained(tiny_whisper_dir))
    processor = WhisperAudioProcessor(WhisperProcessingInfo(ctx))
    stamp = lambda seconds: processor.timestamp_begin + int(round(seconds / 0.02))  # noqa: E731
    tokens = [stamp(0.0), 10, 11, stamp(2.4), stamp(2.4), 12, stamp(5.0), stamp(6.0), 13, 14]
    segments = processor.split_segments(tokens, 20.0)
    assert [(s.start, s.end, s.token_ids) for s in segments] == [
        (0.0, 2.4, [10, 11]), (2.4, 5.0, [12]), (6.0, 20.0, [13, 14])]
    assert [(s.start, s.end) for s in processor.split_segments([10, 11], 7.5)] == [(0.0, 7.5)]
    assert processor.split_segments([], 7.5) == []


def test_windows_cut_at_quiet_points_and_cover_the_audio():
    rate = 1000
    rng = np.random.default_rng(0)
    samples = rng.uniform(-1, 1, rate * 70).astype(np.float32)
    samples[27_300:27_500] = 0.0  # a pause inside the first window's search range
    windows = split_at_quiet_points(samples, rate, max_seconds=30, search_seconds=5)
    assert windows[0].start == 0 and windows[-1].end == samples.shape[0]
    assert all(a.end == b.start for a, b in zip(windows, windows[1:]))
    assert all(0 < w.end - w.start <= 30 * rate for w in windows)
    assert 27_300 <= windows[0].end <= 27_500
    assert 25 * rate <= windows[1].end - windows[1].start <= 30 * rate  # no pause: still within the search range
    assert len(windows) == 3
    assert split_at_quiet_points(samples[:1000], rate, 30) == [type(windows[0])(0, 1000)]
