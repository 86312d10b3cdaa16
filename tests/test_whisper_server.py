"""/v1/audio/transcriptions and /translations over HTTP on the tiny multilingual Whisper.

Random weights, so the words are gibberish, but they must equal transformers' for the same
samples; response formats, streaming, windowing and concurrency are checked on them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest

from whisper_support import hf_whisper_generate, load_hf_whisper, post_audio, read_samples, wav_bytes


def _clip(index: int, seconds: float) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    signal = 0.3 * np.sin(2 * np.pi * (200 + 500 * index) * t) * np.sin(2 * np.pi * t * (index + 1))
    return wav_bytes(signal.astype(np.float32))


def _reference_text(model_dir, data: bytes, **kwargs) -> str:
    _, processor = load_hf_whisper(str(model_dir.resolve()))
    reference = hf_whisper_generate(model_dir, read_samples(data), **kwargs)
    return processor.tokenizer.decode(reference["output_token_ids"], skip_special_tokens=True).strip()


def _json(server, fields, data, path="/v1/audio/transcriptions") -> dict:
    status, body = post_audio(server, fields, data, path)
    assert status == 200, body
    return orjson.loads(body)


def test_transcription_text_equals_transformers(whisper_server, tiny_whisper_dir):
    data = _clip(1, 6.0)
    body = _json(whisper_server, {"language": "en"}, data)
    assert body["text"] == _reference_text(tiny_whisper_dir, data, language="en", task="transcribe")
    assert body["usage"] == {"type": "duration", "seconds": 6.0}


def test_translation_detects_the_language_like_transformers(whisper_server, tiny_whisper_dir):
    data = _clip(2, 9.0)
    body = _json(whisper_server, {}, data, "/v1/audio/translations")
    assert body["text"] == _reference_text(tiny_whisper_dir, data, task="translate")


def test_a_prompt_conditions_the_decoder_as_in_transformers(whisper_server, tiny_whisper_dir):
    import torch

    data = _clip(3, 4.0)
    prompt = "Spell it vlmd. <|notimestamps|> stays text."
    _, processor = load_hf_whisper(str(tiny_whisper_dir.resolve()))
    prompt_ids = processor.tokenizer.encode(" " + prompt, add_special_tokens=False, split_special_tokens=True)
    previous = processor.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    body = _json(whisper_server, {"language": "en", "prompt": prompt}, data)
    expected = _reference_text(tiny_whisper_dir, data, language="en", task="transcribe",
                               prompt_ids=torch.tensor([previous, *prompt_ids]))
    assert body["text"] == expected
    assert body["text"] != _json(whisper_server, {"language": "en"}, data)["text"]


def test_response_formats(whisper_server):
    data = _clip(0, 5.0)
    verbose = _json(whisper_server, {"language": "en", "response_format": "verbose_json"}, data)
    assert verbose["task"] == "transcribe" and verbose["language"] == "english" and verbose["duration"] == 5.0
    segments = verbose["segments"]
    assert segments and [s["id"] for s in segments] == list(range(len(segments)))
    for segment in segments:
        assert 0 <= segment["start"] <= segment["end"] <= 5.0
        assert set(segment) >= {"seek", "text", "tokens", "avg_logprob", "compression_ratio", "temperature",
                                "no_speech_prob"}
        assert segment["avg_logprob"] <= 0
    assert verbose["text"] == " ".join(s["text"].strip() for s in segments if s["text"].strip())

    status, srt = post_audio(whisper_server, {"language": "en", "response_format": "srt"}, data)
    assert status == 200 and srt.decode().startswith("1\n00:00:")
    assert srt.decode().count(" --> ") == len(segments)
    status, vtt = post_audio(whisper_server, {"language": "en", "response_format": "vtt"}, data)
    assert status == 200 and vtt.decode().startswith("WEBVTT\n\n00:00:")
    status, text = post_audio(whisper_server, {"language": "en", "response_format": "text"}, data)
    plain = _json(whisper_server, {"language": "en"}, data)["text"]
    assert status == 200 and text.decode() == plain + "\n"


def test_streaming_sends_deltas_that_add_up_to_the_text(whisper_server):
    data = _clip(4, 40.0)  # two windows: the deltas of the second follow the first's
    status, raw = post_audio(whisper_server, {"language": "en", "stream": "true"}, data)
    assert status == 200
    events = [line[len(b"data: "):] for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    parsed = [orjson.loads(event) for event in events[:-1]]
    deltas = [event["delta"] for event in parsed if event["type"] == "transcript.text.delta"]
    done = parsed[-1]
    assert done["type"] == "transcript.text.done" and deltas
    assert "".join(deltas) == done["text"] == _json(whisper_server, {"language": "en"}, data)["text"]


def test_long_audio_is_cut_into_windows_at_quiet_points(whisper_server):
    # 70 s of tones with a silent gap near 27 s and 55 s: the cuts land in the gaps.
    samples = read_samples(_clip(5, 70.0))
    for gap in (27.0, 55.0):
        samples[int(gap * 16000) : int((gap + 0.4) * 16000)] = 0.0
    verbose = _json(whisper_server, {"language": "en", "response_format": "verbose_json"}, wav_bytes(samples))
    seeks = sorted({segment["seek"] for segment in verbose["segments"]})
    assert len(seeks) == 3 and seeks[0] == 0
    assert 2700 <= seeks[1] <= 2740 and 5500 <= seeks[2] <= 5540  # 10 ms frames
    starts = [segment["start"] for segment in verbose["segments"]]
    assert starts == sorted(starts) and verbose["segments"][-1]["end"] <= 70.0


def test_concurrent_transcriptions_equal_one_at_a_time(whisper_server):
    clips = [_clip(index, 3.0 + 4 * index) for index in range(8)]
    fields = [{"language": "en"}, {"language": "en", "response_format": "verbose_json"}] * 4
    sequential = [post_audio(whisper_server, f, clip) for f, clip in zip(fields, clips)]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda args: post_audio(whisper_server, *args), zip(fields, clips)))
    assert all(status == 200 for status, _ in sequential)
    for (status, body), (expected_status, expected_body) in zip(concurrent, sequential):
        assert status == expected_status
        ours, expected = orjson.loads(body), orjson.loads(expected_body)
        # Same tokens, text and times; log-probs only to float32 noise (batch shapes differ).
        for segment, expected_segment in zip(ours.get("segments", []), expected.get("segments", [])):
            assert segment.pop("avg_logprob") == pytest.approx(expected_segment.pop("avg_logprob"), abs=1e-5)
            assert segment.pop("no_speech_prob") == pytest.approx(expected_segment.pop("no_speech_prob"), abs=1e-6)
        assert ours == expected


@pytest.mark.parametrize("temperature", ["0.7"])
def test_sampled_transcriptions_are_reproducible_with_a_seed(whisper_server, temperature):
    data = _clip(6, 5.0)
    fields = {"language": "en", "temperature": temperature, "seed": "11"}
    first, second = _json(whisper_server, fields, data), _json(whisper_server, fields, data)
    assert first == second


def test_chat_completions_on_a_speech_model_is_a_clear_400(whisper_server):
    status, body = whisper_server.chat({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert status == 400
    assert "/v1/audio/transcriptions" in body["error"]["message"]
    assert whisper_server.request("GET", "/health")[0] == 200


def test_float_arrays_hash_by_value_dtype_and_shape():
    from vlmd.processing.hashing import item_identifier

    samples = np.linspace(-1, 1, 1600, dtype=np.float32)
    same = item_identifier("m", "audio", samples.copy(), {})
    assert item_identifier("m", "audio", samples, {}) == same
    assert item_identifier("m", "audio", samples.astype(np.float64), {}) != same
    assert item_identifier("m", "audio", samples.reshape(40, 40), {}) != same
