"""Gemma 4 with audio (E2B / E4B's conformer tower) through the real server.

The tiny checkpoint is ``gemma4_audio`` (``vlmd_gemma4/tiny.py``: the ``gemma4`` decoder and
vision tower, plus two conformer layers over the real 128-bin features, with drawn clamp
bounds). The tower equals transformers' ``get_audio_features`` vector for vector, in float32;
in float16 it runs in float32 (D113). Through the server: a clip in chat gives transformers'
greedy tokens, alone and concurrently with a text and an image request, as ``input_audio``
and as an ``audio_url`` (a local file); the soft-token count
(``<|audio>`` + n + ``<audio|>``) is transformers' processor's for every clip length;
``/v1/audio/transcriptions`` gives transformers' generate under the model card's
transcription prompt, as json, text and verbose_json (one segment per window); translations,
and bad audio, are a clear 400 and the server keeps serving; `vlmd cost` counts what the
server's usage counts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest

from conftest import Server, image_data_url, random_image
from gemma4_audio_oracle import hf_gemma4_audio_generate, replace_audio_token_count
from gemma4_oracle import hf_gemma4_generate, load_hf_gemma4
from oracle import assert_chat_parity
from qwen2_audio_support import decoded, encode, input_audio, make_clip
from whisper_support import post_audio

# 48,150 samples: 300 valid frames, 75 soft tokens; transformers' padding to 128 samples adds a
# 301st frame, masked (the processor must not hand it to the tower).
SECONDS = 48_150 / 16_000
CLIP = encode(make_clip(SECONDS, 5), "WAV")
IMAGE = random_image(7, 60, 80)


def _audio_body(data: bytes, text: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": [input_audio(data, "wav"), {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "logprobs": True}


def _text_body(content, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}


@pytest.fixture(scope="module")
def server(tiny_gemma4_audio_dir, media_dir, tmp_path_factory):
    server = Server(tiny_gemma4_audio_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=1,audio=2,video=0",
                    "--allowed-local-media-path", str(media_dir),
                    "--media-io-kwargs", '{"audio": {"max_bytes": 3000000}}', name="tiny-gemma4-audio",
                    log_dir=tmp_path_factory.mktemp("gemma4-audio-logs"))
    yield server
    server.stop()


def test_soft_tokens_are_transformers_processors_count(tiny_gemma4_audio_dir):
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from vlmd_gemma4.audio_processing import AudioSettings

    settings = AudioSettings(str(tiny_gemma4_audio_dir))
    extractor = Gemma4AudioFeatureExtractor(**settings.feature_settings)
    for length in (1, 160, 161, 320, 321, 481, 799, 16000, 16001, 48000, 48077, 479_999, 480_000):
        mask = extractor([np.full(length, 0.1, np.float32)], return_tensors="np")["input_features_mask"][0]
        assert settings.valid_frames(length) == int(mask.sum()), length
        assert settings.soft_tokens(length) == replace_audio_token_count(mask), length
    assert settings.soft_tokens(480_000) == 750 and settings.max_samples == 480_000  # 25 tokens a second, 30 s


def test_the_tower_equals_transformers_and_float16_runs_it_in_float32(tiny_gemma4_audio_dir):
    import torch
    from transformers import AutoConfig
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from vlmd_gemma4.audio_processing import AudioSettings
    from vlmd_gemma4.model import Gemma4Model

    hf, _ = load_hf_gemma4(str(tiny_gemma4_audio_dir.resolve()))
    config = AutoConfig.from_pretrained(tiny_gemma4_audio_dir)
    ours = Gemma4Model.load(tiny_gemma4_audio_dir, config, torch.float32)
    extractor = Gemma4AudioFeatureExtractor(**AudioSettings(str(tiny_gemma4_audio_dir)).feature_settings)
    clips = [make_clip(2.7, 11), make_clip(0.45, 12)]  # one batch: the short one padded, as transformers pads
    extracted = extractor(clips, return_tensors="pt")
    with torch.no_grad():
        reference = hf.model.get_audio_features(extracted["input_features"], extracted["input_features_mask"],
                                                return_dict=True)
        inputs = [{"input_features": features[mask].numpy()}
                  for features, mask in zip(extracted["input_features"], extracted["input_features_mask"])]
        vectors = ours.embed_multimodal("audio", inputs)
        for index, got in enumerate(vectors):
            expected = reference.pooler_output[index][reference.attention_mask[index]]
            assert got.shape == expected.shape and got.shape[0] > 5
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        half = Gemma4Model.load(tiny_gemma4_audio_dir, config, torch.float16)
        assert half.audio_tower.output_proj.weight.dtype == torch.float32
        assert half.language_model.embed_tokens.weight.dtype == torch.float16
        got = half.embed_multimodal("audio", inputs[:1])[0]
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), vectors[0], atol=5e-3, rtol=5e-3)


@pytest.fixture(scope="module")
def references(tiny_gemma4_audio_dir):
    audio_messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]}]
    return {
        "audio": hf_gemma4_audio_generate(tiny_gemma4_audio_dir, audio_messages, [decoded(CLIP)], 10),
        "text": hf_gemma4_generate(tiny_gemma4_audio_dir, [{"role": "user", "content": [
            {"type": "text", "text": "Write a short poem about the sea."}]}], [], 10),
        "image": hf_gemma4_generate(tiny_gemma4_audio_dir, [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Describe the image."}]}], [IMAGE], 10),
    }


def _bodies():
    return {
        "audio": _audio_body(CLIP, "What is it?", 10),
        "text": _text_body([{"type": "text", "text": "Write a short poem about the sea."}], 10),
        "image": _text_body([{"type": "image_url", "image_url": {"url": image_data_url(IMAGE)}},
                             {"type": "text", "text": "Describe the image."}], 10),
    }


def test_a_clip_in_chat_equals_transformers_alone_and_concurrently(server, references, tiny_gemma4_audio_dir):
    import json

    ids = json.loads((tiny_gemma4_audio_dir / "vlmd_tiny.json").read_text())
    status, body = server.chat(_bodies()["audio"])
    assert status == 200, body
    assert_chat_parity(body, references["audio"])
    prompt = body["prompt_token_ids"]
    assert prompt.count(ids["audio_token_id"]) == 75
    first = prompt.index(ids["audio_token_id"])
    assert prompt[first - 1] == ids["boa_token_id"] and prompt[first + 75] == ids["eoa_token_id"]
    assert len(references["audio"]["output_token_ids"]) > 3
    bodies = _bodies()
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(server.chat, [*bodies.values()] * 2))
    for name, (status, answer) in zip([*bodies] * 2, answers):
        assert status == 200, answer
        assert_chat_parity(answer, references[name])


def test_an_audio_url_is_the_same_clip(server, references, media_dir):
    path = media_dir / "gemma4-audio-clip.wav"
    path.write_bytes(CLIP)
    body = _audio_body(CLIP, "What is it?", 10)
    body["messages"][0]["content"][0] = {"type": "audio_url", "audio_url": {"url": path.as_uri()}}
    status, answer = server.chat(body)
    assert status == 200, answer
    assert_chat_parity(answer, references["audio"])


@pytest.fixture(scope="module")
def transcription_reference(tiny_gemma4_audio_dir):
    from vlmd.processing.speech import DEFAULT_WINDOW_TOKENS
    from vlmd_gemma4.audio_processing import transcription_instruction

    messages = [{"role": "user", "content": [{"type": "audio"},
                                             {"type": "text", "text": transcription_instruction(None)}]}]
    reference = hf_gemma4_audio_generate(tiny_gemma4_audio_dir, messages, [decoded(CLIP)], DEFAULT_WINDOW_TOKENS)
    _, tokenizer = load_hf_gemma4(str(tiny_gemma4_audio_dir.resolve()))
    reference["text"] = tokenizer.decode(reference["output_token_ids"], skip_special_tokens=True).strip()
    return reference


def test_transcriptions_equal_transformers_in_whispers_formats(server, transcription_reference):
    expected = transcription_reference["text"]
    assert expected
    status, raw = post_audio(server, {}, CLIP)
    assert status == 200, raw
    assert orjson.loads(raw) == {"text": expected, "usage": {"type": "duration", "seconds": round(SECONDS, 3)}}
    status, text = post_audio(server, {"response_format": "text"}, CLIP)
    assert status == 200 and text.decode() == expected + "\n"
    status, raw = post_audio(server, {"response_format": "verbose_json"}, CLIP)
    assert status == 200, raw
    verbose = orjson.loads(raw)
    assert verbose["task"] == "transcribe" and verbose["duration"] == round(SECONDS, 3) and verbose["text"] == expected
    (segment,) = verbose["segments"]  # one window, one segment spanning it
    assert segment["start"] == 0.0 and segment["end"] == round(SECONDS, 3) and segment["text"].strip() == expected
    assert segment["avg_logprob"] <= 0


def test_language_and_prompt_go_into_the_instruction(server, tiny_gemma4_audio_dir, transcription_reference):
    """``language=en``: the card's "in English into English text"; a ``prompt`` follows the
    instruction as context (as Qwen2-Audio's); both equal transformers' generate on that prompt."""
    from vlmd.processing.speech import DEFAULT_WINDOW_TOKENS
    from vlmd_gemma4.audio_processing import transcription_instruction

    instruction = transcription_instruction("en") + "\nContext: Names: Ada."
    assert "in English into English text" in instruction
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction}]}]
    reference = hf_gemma4_audio_generate(tiny_gemma4_audio_dir, messages, [decoded(CLIP)], DEFAULT_WINDOW_TOKENS)
    assert reference["prompt_token_ids"] != transcription_reference["prompt_token_ids"]
    assert reference["output_token_ids"]
    _, tokenizer = load_hf_gemma4(str(tiny_gemma4_audio_dir.resolve()))
    status, raw = post_audio(server, {"language": "en", "prompt": "Names: Ada."}, CLIP)
    assert status == 200, raw
    assert orjson.loads(raw)["text"] == tokenizer.decode(reference["output_token_ids"], skip_special_tokens=True).strip()


def test_translations_and_bad_audio_are_a_400_and_the_server_keeps_serving(server, references):
    status, raw = post_audio(server, {}, CLIP, path="/v1/audio/translations")
    assert status == 400 and "cannot translate" in orjson.loads(raw)["error"]["message"]
    cases = [
        (input_audio(b"this is not audio at all" * 40, "wav"), "cannot decode the audio data"),
        (input_audio(encode(make_clip(31.0, 3), "WAV"), "wav"), "at most 30 s per clip"),
        (input_audio(encode(make_clip(0.005, 4), "WAV"), "wav"), "too short"),
    ]
    for part, message in cases:
        status, body = server.chat({"messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
        assert status == 400 and message in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error"
    status, raw = post_audio(server, {}, b"not audio" * 50)
    assert status == 400, raw
    status, body = server.chat(_bodies()["audio"])
    assert status == 200
    assert_chat_parity(body, references["audio"])


def test_cost_counts_the_servers_audio_tokens(server, references, transcription_reference, tiny_gemma4_audio_dir):
    from vlmd.cost import CostOptions, ItemSpec, compute_cost
    from vlmd.processing.base import ItemSize

    report = compute_cost(str(tiny_gemma4_audio_dir), [ItemSpec("audio", "the clip", ItemSize(seconds=SECONDS))],
                          CostOptions())
    (row,) = report["items"]
    status, body = server.chat(_bodies()["audio"])
    assert status == 200, body
    ids = __import__("json").loads((tiny_gemma4_audio_dir / "vlmd_tiny.json").read_text())
    in_prompt = sum(body["prompt_token_ids"].count(ids[name]) for name in ("boa_token_id", "audio_token_id", "eoa_token_id"))
    assert row["prompt_tokens"] == in_prompt == 77 and row["placeholder_tokens"] == row["encoder_tokens"] == 75
    window = next(r for r in report["requests"] if r["request"] == "transcription window")
    assert window["prompt_tokens"] == len(transcription_reference["prompt_token_ids"])


def test_audio_stays_causal_where_images_attend_both_ways(tiny_gemma4_audio_dir):
    """transformers marks only vision tokens (types 1, 2) for bidirectional attention; an
    audio clip's soft tokens (type 3) stay causal, so they bring no span."""
    from transformers import AutoConfig

    from vlmd.types import MultiModalItem
    from vlmd_gemma4.model import Gemma4Model

    config = AutoConfig.from_pretrained(tiny_gemma4_audio_dir)
    config.text_config.use_bidirectional_attention = "vision"
    model = Gemma4Model(config)
    items = [MultiModalItem(modality="audio", identifier="a", offset=3, length=75),
             MultiModalItem(modality="image", identifier="i", offset=90, length=20)]
    assert model.attention_spans(items) == [(90, 110)]


def test_audio_limited_to_zero_frees_the_tower_and_refuses_audio(tiny_gemma4_audio_dir, tmp_path):
    """``--limit-mm-per-prompt audio=0``: the tower and its embedder are dropped before the
    model goes to the device, a clip in chat and /v1/audio/transcriptions are a 400, images
    still work."""
    server = Server(tiny_gemma4_audio_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=1,audio=0,video=0",
                    log_dir=tmp_path)
    try:
        status, body = server.chat(_audio_body(CLIP, "What is it?", 2))
        assert status == 400 and "audio" in body["error"]["message"], body
        status, raw = post_audio(server, {}, CLIP)
        assert status == 400 and "does not take audio" in orjson.loads(raw)["error"]["message"], raw
        status, body = server.chat(_bodies()["image"])
        assert status == 200, body
    finally:
        server.stop()
    plan = next(line for line in server.log_path.read_text().splitlines() if "memory plan" in line)
    assert "audio_tower" in plan and "embed_audio" in plan and "vision_tower" not in plan
