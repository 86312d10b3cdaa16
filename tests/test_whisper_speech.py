"""Real speech (espeak-ng) through `vlmd serve` on the real tiny.en weights.

The paragraph must be recognised (word error rate <= 0.2 with jiwer, after lower-casing and
dropping punctuation) and come out exactly as transformers transcribes the same samples with
the same weights; a 70 s clip is one transcript from three windows, in order; eight
concurrent uploads equal the same uploads one at a time.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson

from whisper_support import (
    LIBRARY, PARAGRAPH, SENTENCES, TRAIN, WEATHER, hf_whisper_generate, load_hf_whisper, needs_espeak, needs_tiny_en,
    post_audio, read_samples, silence, speech_wav, wav_bytes,
)

pytestmark = [needs_tiny_en, needs_espeak]


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def word_error_rate(reference: str, hypothesis: str) -> float:
    import jiwer

    return jiwer.wer(words(reference), words(hypothesis))


def _text(server, data: bytes, **fields) -> str:
    status, body = post_audio(server, fields, data)
    assert status == 200, body
    return orjson.loads(body)["text"]


def test_paragraph_is_recognised_exactly_as_transformers_does(tiny_en_server, tiny_en_dir):
    data = speech_wav(PARAGRAPH)
    samples = read_samples(data)
    assert 25.0 <= samples.shape[0] / 16000 <= 30.0
    served = _text(tiny_en_server, data)
    assert word_error_rate(PARAGRAPH, served) <= 0.2, served
    _, processor = load_hf_whisper(str(tiny_en_dir.resolve()))
    reference = hf_whisper_generate(tiny_en_dir, samples)["output_token_ids"]
    assert served == processor.tokenizer.decode(reference, skip_special_tokens=True).strip()


def test_a_70_second_clip_is_one_transcript_from_three_windows_in_order(tiny_en_server):
    texts = (PARAGRAPH, LIBRARY, WEATHER, TRAIN)  # 72 s of speech with 1 s pauses between
    parts = [read_samples(speech_wav(text)) for text in texts]
    samples = np.concatenate([np.concatenate([part, silence(1.0)]) for part in parts])
    assert samples.shape[0] / 16000 >= 70
    status, body = post_audio(tiny_en_server, {"response_format": "verbose_json"}, wav_bytes(samples))
    assert status == 200, body
    verbose = orjson.loads(body)
    assert verbose["duration"] >= 70
    seeks = sorted({segment["seek"] for segment in verbose["segments"]})
    assert len(seeks) == 3 and seeks[0] == 0, seeks  # three windows, each with speech
    starts = [segment["start"] for segment in verbose["segments"]]
    assert starts == sorted(starts) and verbose["segments"][-1]["end"] <= verbose["duration"]
    for segment in verbose["segments"]:
        assert segment["seek"] / 100 - 1e-6 <= segment["start"] <= segment["end"]
    text = verbose["text"].lower()
    positions = [text.find(word) for word in ("fisherman", "librar", "coast", "train")]
    assert -1 not in positions and positions == sorted(positions), text
    assert word_error_rate(" ".join(texts), verbose["text"]) <= 0.2, verbose["text"]


def test_eight_concurrent_transcriptions_equal_one_at_a_time(tiny_en_server):
    clips = [speech_wav(sentence) for sentence in SENTENCES]
    sequential = [_text(tiny_en_server, clip) for clip in clips]
    with ThreadPoolExecutor(len(clips)) as pool:
        concurrent = list(pool.map(lambda clip: _text(tiny_en_server, clip), clips))
    assert concurrent == sequential
    assert word_error_rate(" ".join(SENTENCES), " ".join(sequential)) <= 0.25, sequential


def test_english_only_model_refuses_translation_and_other_languages(tiny_en_server):
    data = speech_wav(SENTENCES[0])
    status, body = post_audio(tiny_en_server, {}, data, "/v1/audio/translations")
    assert status == 400 and b"English-only" in body
    status, body = post_audio(tiny_en_server, {"language": "fr"}, data)
    assert status == 400 and orjson.loads(body)["error"]["param"] == "language"
    assert "quick brown fox" in _text(tiny_en_server, data, language="en").lower()
