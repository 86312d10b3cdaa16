"""The official openai client on the audio routes: translations, verbose_json's figures, fallback fields.

The texts themselves are tied to transformers by tests/test_whisper_server.py (over raw
HTTP); here the client must parse what vlmd sends and get the same answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from whisper_support import FOX, needs_espeak, needs_tiny_en, post_audio, speech_wav, wav_bytes

openai = pytest.importorskip("openai")


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _tones(seconds: float) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    return wav_bytes((0.3 * np.sin(2 * np.pi * 700 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32))


def test_translations_through_the_client_equal_the_http_route(whisper_server):
    import orjson

    data = _tones(3.0)
    translated = _client(whisper_server).audio.translations.create(model=whisper_server.model, file=("a.wav", data))
    status, body = post_audio(whisper_server, {}, data, "/v1/audio/translations")
    assert status == 200 and translated.text == orjson.loads(body)["text"]
    verbose = _client(whisper_server).audio.translations.create(
        model=whisper_server.model, file=("a.wav", data), response_format="verbose_json")
    assert verbose.task == "translate" and verbose.text == translated.text
    assert verbose.segments and all(segment.temperature == 0.0 for segment in verbose.segments)


def test_verbose_json_segments_parse_with_their_figures(whisper_server):
    client = _client(whisper_server)
    result = client.audio.transcriptions.create(model=whisper_server.model, file=("a.wav", _tones(2.5)),
                                                language="en", response_format="verbose_json",
                                                timestamp_granularities=["segment"])
    for segment in result.segments:
        assert segment.temperature == 0.0 and segment.avg_logprob <= 0.0
        assert 0.0 <= segment.no_speech_prob <= 1.0 and segment.compression_ratio > 0.0
    # The thresholds are extension fields: the client sends them with extra_body.
    forced = client.audio.transcriptions.create(model=whisper_server.model, file=("a.wav", _tones(2.5)),
                                                language="en", response_format="verbose_json",
                                                extra_body={"logprob_threshold": "0.5", "seed": "5"})
    assert forced.segments and {segment.temperature for segment in forced.segments} == {1.0}


@needs_tiny_en
@needs_espeak
def test_an_english_only_model_refuses_translation_through_the_client(tiny_en_server):
    client = _client(tiny_en_server)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.translations.create(model=tiny_en_server.model, file=("fox.wav", speech_wav(FOX)))
    assert "English-only" in info.value.message and info.value.body["param"] == "model"
