"""Word timestamps (``timestamp_granularities[]=word``) against transformers, through the openai client.

The oracle is transformers' own word timing: ``generate(..., return_timestamps=True,
return_token_timestamps=True)`` on the features vlmd's other parity tests feed it (the
alignment heads' cross-attention, normalised, median-filtered, time-warped), then the ASR
pipeline's own post-processing (``tokenizer._decode_asr`` with ``return_timestamps="word"``,
which groups tokens into words). vlmd computes the same thing in its own code, so texts must
be equal and times equal to within one 20 ms encoder frame (a near-tie in the warping may
move a boundary by one frame where float rounding differs). Real speech (espeak-ng) on the
real tiny.en weights in a clip of two windows (each window's words offset by its start), and
the random tiny multilingual checkpoint (whose odd tokens, a language token among them, and
decode cut at its length limit exercise the grouping).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from whisper_support import (
    FOX, PARAGRAPH, load_hf_whisper, needs_espeak, needs_tiny_en, post_audio, read_samples, speech_wav,
    wav_bytes,
)

openai = pytest.importorskip("openai")

FRAME = 0.02
NO_FALLBACK = {"compression_ratio_threshold": "none", "logprob_threshold": "none", "no_speech_threshold": "none"}


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)


def oracle_words(model_dir, samples: np.ndarray, **generate_kwargs) -> list[tuple[str, float, float]]:
    """transformers' words for one window of samples: (text, start, end) in seconds from its start."""
    import torch

    model, processor = load_hf_whisper(str(Path(model_dir).resolve()))
    inputs = processor(samples, sampling_rate=16000, return_tensors="pt", return_attention_mask=True)
    with torch.inference_mode():
        out = model.generate(inputs.input_features, attention_mask=inputs.attention_mask, do_sample=False,
                             num_beams=1, return_timestamps=True, return_token_timestamps=True, return_segments=True,
                             **generate_kwargs)
    # As the ASR pipeline hands generate's output to its post-processing.
    timestamps = torch.cat([segment["token_timestamps"] for segment in out["segments"][0]])
    _, chunks = processor.tokenizer._decode_asr(
        [{"tokens": out["sequences"], "token_timestamps": [timestamps]}], return_timestamps="word",
        return_language=None, time_precision=FRAME,
    )
    return [(chunk["text"].strip(), *chunk["timestamp"]) for chunk in chunks["chunks"] if chunk["text"].strip()]


def assert_words_match(served: list, expected: list[tuple[str, float, float]], offset: float = 0.0) -> None:
    assert [word["word"] for word in served] == [text for text, _, _ in expected]
    for word, (_, start, end) in zip(served, expected):
        assert abs(word["start"] - (offset + start)) <= FRAME + 1e-3, (word, start)
        assert abs(word["end"] - (offset + end)) <= FRAME + 1e-3, (word, end)


def _words(result) -> list[dict]:
    return [{"word": word.word, "start": word.start, "end": word.end} for word in result.words]


def test_the_time_warping_path_equals_transformers():
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping
    from vlmd_whisper.word_timing import dtw_path

    rng = np.random.default_rng(0)
    matrices = [rng.standard_normal((rows, cols)) for rows, cols in ((1, 1), (1, 9), (7, 1), (12, 40), (40, 12))]
    matrices.append(rng.integers(0, 3, (9, 30)).astype(np.float64))  # ties: the tie-breaks must agree too
    for matrix in matrices:
        ours, theirs = dtw_path(matrix), _dynamic_time_warping(matrix)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1]), matrix.shape


@needs_tiny_en
@needs_espeak
def test_words_of_real_speech_in_two_windows_equal_transformers(tiny_en_server, tiny_en_dir):
    """28 s of speech, a pause, a sentence: two windows, each one's words offset by its start."""
    from vlmd.processing.audio_windows import split_at_quiet_points
    from vlmd.processing.transcription import QUIET_SEARCH_SECONDS

    samples = np.concatenate([read_samples(speech_wav(PARAGRAPH)), np.zeros(16000, np.float32),
                              read_samples(speech_wav(FOX))])
    windows = split_at_quiet_points(samples, 16000, 30.0, QUIET_SEARCH_SECONDS)
    assert len(windows) == 2 and windows[1].start / 16000 > 25.0
    result = _client(tiny_en_server).audio.transcriptions.create(
        model=tiny_en_server.model, file=("speech.wav", wav_bytes(samples)), response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert result.segments is None  # words alone, as OpenAI's API answers them
    served = _words(result)
    expected = [oracle_words(tiny_en_dir, samples[window.start : window.end]) for window in windows]
    assert len(expected[0]) >= 60 and len(expected[1]) >= 8
    assert_words_match(served[: len(expected[0])], expected[0])
    assert_words_match(served[len(expected[0]) :], expected[1], offset=windows[1].start / 16000)
    assert " ".join(word["word"] for word in served) == result.text


@needs_tiny_en
@needs_espeak
def test_words_and_segments_together(tiny_en_server):
    data = speech_wav(FOX)
    client = _client(tiny_en_server)
    both = client.audio.transcriptions.create(model=tiny_en_server.model, file=("fox.wav", data),
                                              response_format="verbose_json", timestamp_granularities=["word", "segment"])
    segments_only = client.audio.transcriptions.create(model=tiny_en_server.model, file=("fox.wav", data),
                                                       response_format="verbose_json")
    assert both.words and segments_only.words is None
    assert [s.model_dump() for s in both.segments] == [s.model_dump() for s in segments_only.segments]
    ends = [0.0] + [word.end for word in both.words]
    assert all(word.start >= ends[index] - 1e-9 and word.end >= word.start for index, word in enumerate(both.words))
    assert ends[-1] <= both.duration


def test_words_of_the_tiny_checkpoint_equal_transformers(whisper_server, tiny_whisper_dir):
    t = np.arange(16000 * 6) / 16000
    samples = (0.3 * np.sin(2 * np.pi * 700 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32)
    data = wav_bytes(samples)
    result = _client(whisper_server).audio.transcriptions.create(
        model=whisper_server.model, file=("tones.wav", data), language="en", response_format="verbose_json",
        timestamp_granularities=["word", "segment"], extra_body=NO_FALLBACK,
    )
    expected = oracle_words(tiny_whisper_dir, read_samples(data), language="en", task="transcribe")
    assert expected  # random weights still say something
    assert_words_match(_words(result), expected)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"timestamp_granularities[]": "word"}, "needs response_format verbose_json"),
        ({"timestamp_granularities[]": "word", "response_format": "srt"}, "needs response_format verbose_json"),
        ({"timestamp_granularities[]": ["word", "char"], "response_format": "verbose_json"}, "not ['char']"),
    ],
    ids=["json", "srt", "char"],
)
def test_bad_combinations_are_400(whisper_server, fields, fragment):
    status, body = post_audio(whisper_server, fields, wav_bytes(np.zeros(16000, np.float32)))
    error = orjson.loads(body)["error"]
    assert status == 400 and error["param"] == "timestamp_granularities" and fragment in error["message"]


def test_a_model_without_alignment_heads_refuses_words(qwen2_audio_server):
    with pytest.raises(openai.BadRequestError) as info:
        _client(qwen2_audio_server).audio.transcriptions.create(
            model=qwen2_audio_server.model, file=("a.wav", wav_bytes(np.zeros(16000, np.float32))),
            response_format="verbose_json", timestamp_granularities=["word"],
        )
    assert "cannot time words" in info.value.message and info.value.body["param"] == "timestamp_granularities"
