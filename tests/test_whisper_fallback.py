"""verbose_json's per-window figures and the temperature fallback, over HTTP.

``avg_logprob`` and ``no_speech_prob`` must equal what transformers computes on the same
samples (its own ``_retrieve_avg_logprobs`` over its processed scores, its own
``WhisperNoSpeechDetection``); ``compression_ratio`` is openai-whisper's (zlib over the
window's text; transformers measures token bytes instead). The fallback is forced by
thresholds no decode can meet, so what is checked is its bookkeeping (the temperature the
kept decode ran at, a silent window dropped), never sampled words.
"""

from __future__ import annotations

import zlib

import numpy as np
import orjson
import pytest

from whisper_support import FOX, load_hf_whisper, needs_espeak, needs_tiny_en, post_audio, read_samples, speech_wav, wav_bytes


def _oracle(model_dir, samples: np.ndarray, **generate_kwargs) -> dict:
    """transformers' greedy decode with timestamps: tokens, average log-prob, no-speech probability."""
    import torch
    from transformers.generation.logits_process import WhisperNoSpeechDetection

    model, processor = load_hf_whisper(str(model_dir.resolve()))
    features = processor(samples, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        out = model.generate(features, do_sample=False, num_beams=1, output_scores=True, return_dict_in_generate=True,
                             return_timestamps=True, **generate_kwargs)
        result = out["segments"][0][0]["result"]  # the window's one decode, shared by its segments
        scores, sequence = result["scores"], result["sequences"]
        generated, prompt = sequence[-len(scores):], sequence[: -len(scores)]
        detector = WhisperNoSpeechDetection(model.generation_config.no_timestamps_token_id - 1, begin_index=len(prompt))
        detector.set_model(model)
        detector.set_inputs({"inputs": features, "input_ids": prompt[None]})
        detector(prompt[None], model(input_features=features, decoder_input_ids=prompt[None]).logits[:, -1])
    eos = model.generation_config.eos_token_id
    tokens = generated.tolist()
    text_tokens = [token for token in tokens if token < eos]
    return {
        "text_tokens": text_tokens,
        # transformers averages over the tokens it sampled; openai-whisper (and vlmd) over the
        # tokens before the end of text, plus one, so a decode cut at the length limit
        # divides by one more: the sum of log-probs is transformers' either way.
        "avg_logprob": float(model._retrieve_avg_logprobs(scores, generated, 0.0)) * len(tokens)
        / (len(tokens) - (tokens[-1] == eos) + 1),
        "no_speech_prob": float(detector.no_speech_prob[0]),
        "text": processor.tokenizer.decode(text_tokens, skip_special_tokens=True).strip(),
    }


def _verbose(server, data: bytes, **fields) -> dict:
    status, body = post_audio(server, {"response_format": "verbose_json", **fields}, data)
    assert status == 200, body
    return orjson.loads(body)


def _assert_window_figures(verbose: dict, expected: dict) -> None:
    segments = verbose["segments"]
    assert segments
    assert [token for segment in segments for token in segment["tokens"]] == expected["text_tokens"]
    encoded = expected["text"].encode()
    for segment in segments:
        assert segment["temperature"] == 0.0
        assert segment["avg_logprob"] == pytest.approx(expected["avg_logprob"], abs=2e-4)
        assert segment["no_speech_prob"] == pytest.approx(expected["no_speech_prob"], abs=1e-5)
        assert segment["compression_ratio"] == pytest.approx(len(encoded) / len(zlib.compress(encoded)), rel=1e-12)


@needs_tiny_en
@needs_espeak
def test_real_speech_figures_equal_transformers(tiny_en_server, tiny_en_dir):
    data = speech_wav(FOX)
    verbose = _verbose(tiny_en_server, data)
    expected = _oracle(tiny_en_dir, read_samples(data))
    _assert_window_figures(verbose, expected)
    assert verbose["text"] == expected["text"]
    assert 0.0 < verbose["segments"][0]["no_speech_prob"] < 0.6  # speech: no fallback, nothing skipped


def test_multilingual_figures_equal_transformers(whisper_server, tiny_whisper_dir):
    # The prompt is <|sot|> <|en|> <|transcribe|>: the no-speech probability is read two
    # positions back (transformers runs a second forward for it; vlmd a one-step probe).
    t = np.arange(16000 * 4) / 16000
    samples = (0.3 * np.sin(2 * np.pi * 300 * t) * np.sin(2 * np.pi * t)).astype(np.float32)
    data = wav_bytes(samples)
    verbose = _verbose(whisper_server, data, language="en")
    _assert_window_figures(verbose, _oracle(tiny_whisper_dir, read_samples(data), language="en", task="transcribe"))


def _tones(seconds: float, pitch: float = 300.0) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    return wav_bytes((0.3 * np.sin(2 * np.pi * pitch * t) * np.sin(2 * np.pi * t)).astype(np.float32))


@pytest.mark.parametrize(("field", "value"), [("logprob_threshold", "0.5"), ("compression_ratio_threshold", "0.01")])
def test_a_window_failing_the_thresholds_is_decoded_up_the_ladder(whisper_server, field, value):
    # No decode has a log-prob average >= 0.5 or a compression ratio <= 0.01: every
    # temperature fails, and the last one (1.0) is kept, as in openai-whisper. Greedy, the
    # same window passes the default thresholds (avg_logprob about -0.3, ratio about 1.3).
    data = _tones(3.0)
    greedy = _verbose(whisper_server, data, language="en")
    assert {s["temperature"] for s in greedy["segments"]} == {0.0}
    fields = {"language": "en", field: value, "seed": "7"}
    first, second = _verbose(whisper_server, data, **fields), _verbose(whisper_server, data, **fields)
    assert first["segments"] and {s["temperature"] for s in first["segments"]} == {1.0}
    assert _exact(first) == _exact(second)  # sampled retries are reproducible with a seed


def _exact(verbose: dict) -> dict:
    """The body without its float figures (those vary with the batch a step ran in, ~1e-6)."""
    figures = ("avg_logprob", "no_speech_prob", "compression_ratio")
    return {**verbose, "segments": [{k: v for k, v in s.items() if k not in figures} for s in verbose["segments"]]}


def test_a_client_temperature_is_one_decode_at_that_temperature(whisper_server):
    verbose = _verbose(whisper_server, _tones(2.0), language="en", temperature="0.4", seed="3", logprob_threshold="0.5")
    assert {s["temperature"] for s in verbose["segments"]} == {0.4}  # failing, but no ladder


def test_a_window_judged_silent_gives_no_text(whisper_server):
    # Likely silence (no-speech probability over 0) and unsure (log-prob under 0.5): skipped,
    # as openai-whisper skips it, in every format; with the test off the text is kept.
    data = _tones(2.0, pitch=500.0)
    fields = {"language": "en", "no_speech_threshold": "0", "logprob_threshold": "0.5"}
    verbose = _verbose(whisper_server, data, **fields)
    assert verbose["text"] == "" and verbose["segments"] == []
    status, body = post_audio(whisper_server, fields, data)
    assert status == 200 and orjson.loads(body)["text"] == ""
    status, body = post_audio(whisper_server, {**fields, "no_speech_threshold": "none", "temperature": "0.2",
                                               "seed": "1"}, data)
    assert status == 200 and orjson.loads(body)["text"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"no_speech_threshold": "1.5"}, "no_speech_threshold"),
        ({"compression_ratio_threshold": "0"}, "compression_ratio_threshold"),
        ({"logprob_threshold": "-inf"}, "logprob_threshold"),
        ({"logprob_threshold": "low"}, "logprob_threshold"),
        ({"logprob_threshold": "-1", "stream": "true"}, "logprob_threshold"),
    ],
)
def test_bad_thresholds_are_400s_naming_the_field(whisper_server, fields, param):
    status, body = post_audio(whisper_server, fields, wav_bytes(np.zeros(8000, dtype=np.float32)))
    assert status == 400, body
    assert orjson.loads(body)["error"]["param"] == param


def test_the_rules_are_openai_whispers():
    from vlmd.processing.temperature_fallback import FallbackThresholds, WindowDecode, temperature_ladder

    assert temperature_ladder(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0) and temperature_ladder(0.3) == (0.3,)
    # Three tokens and the end of text: the sum over four log-probs, divided by 3 + 1.
    unsure = WindowDecode([1, 2, 3], [-1.0, -2.0, -1.5, -0.5], 0.0, "hello there", no_speech_prob=0.7)
    assert unsure.avg_logprob == -1.25
    defaults = FallbackThresholds()
    assert not unsure.needs_fallback(defaults) and unsure.is_silence(defaults)  # silence: skipped, not retried
    speech = WindowDecode([1, 2, 3], [-1.0, -2.0, -1.5, -0.5], 0.0, "hello there", no_speech_prob=0.1)
    assert speech.needs_fallback(defaults) and not speech.is_silence(defaults)
    assert not speech.needs_fallback(FallbackThresholds(logprob=None))
    assert unsure.is_silence(FallbackThresholds(logprob=None)) and not unsure.is_silence(FallbackThresholds(no_speech=None))
    repeated = WindowDecode([1], [-0.1, -0.1], 0.0, "la " * 40, no_speech_prob=0.0)
    assert repeated.compression_ratio > 2.4 and repeated.needs_fallback(defaults)
    assert not repeated.needs_fallback(FallbackThresholds(compression_ratio=None))
