"""Qwen2-Audio beyond parity: bad audio is a clear 400 (and the server keeps serving), the
processor's features and placeholder counts equal transformers', transcriptions through a
decoder-only model, and the tiny checkpoint's rules (byte-identical per seed, offline load)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import threading

import numpy as np
import openai
import pytest
import soundfile as sf

from oracle import assert_greedy_match
from qwen2_audio_oracle import hf_qwen2_audio_generate, load_hf_qwen2_audio
from qwen2_audio_support import decoded, encode, input_audio, make_clip, text
from vlmd.media.audio import decode_audio
from vlmd.media.policy import MediaPolicy


def _good(server) -> None:
    status, body = server.chat({"messages": [{"role": "user", "content": [
        input_audio(encode(make_clip(1.0, 20), "WAV"), "wav"), text("Hi")]}], "max_tokens": 2})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 25


def _audio_chat(*parts) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, text("What is it?")]}], "max_tokens": 2}


WAV_1S = encode(make_clip(1.0, 21), "WAV")


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([input_audio(b"this is not audio at all" * 40, "wav")], "cannot decode the audio data"),
        ([input_audio(encode(make_clip(31.0, 22), "WAV"), "wav")], "at most 30 s per clip"),
        ([input_audio(encode(make_clip(100.0, 23), "WAV"), "wav")], "larger than the media size limit of 3000000"),
        ([input_audio(WAV_1S, "aac")], "input_audio.format must be one of"),
        ([{"type": "input_audio", "input_audio": {"format": "wav"}}], "input_audio.data must be a non-empty"),
        ([input_audio(WAV_1S, "wav")] * 3, "at most 2 audio(s)"),
        ([{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}], "allowed-local-media-path"),
    ],
    ids=["not-audio", "too-long", "too-large", "wrong-format-name", "no-data", "too-many-clips", "file-outside"],
)
def test_bad_audio_is_a_400_and_the_server_keeps_serving(qwen2_audio_server, parts, message):
    status, body = qwen2_audio_server.chat(_audio_chat(*parts))
    assert status == 400, body
    assert message in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"
    _good(qwen2_audio_server)


def test_audio_to_a_model_without_audio_names_the_model(llava_server):
    for part in (input_audio(WAV_1S, "wav"), {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AA"}}):
        status, body = llava_server.chat(_audio_chat(part))
        assert status == 400, body
        assert "the model `tiny` does not accept audio input" in body["error"]["message"]
    status, body = llava_server.chat({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    assert status == 200, body


def test_features_and_placeholder_counts_equal_transformers(qwen2_audio_server, tiny_qwen2_audio_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.errors import BadRequestError
    from vlmd.processing.base import ProcessingContext
    from vlmd_qwen2_audio.processing import Qwen2AudioProcessingInfo, Qwen2AudioProcessor

    ctx = ProcessingContext(str(tiny_qwen2_audio_dir), "tiny", AutoConfig.from_pretrained(tiny_qwen2_audio_dir),
                            AutoTokenizer.from_pretrained(tiny_qwen2_audio_dir))
    ours = Qwen2AudioProcessor(Qwen2AudioProcessingInfo(ctx))
    _, hf = load_hf_qwen2_audio(tiny_qwen2_audio_dir)
    for length in (1, 320):  # transformers would give these no placeholder: refused
        with pytest.raises(BadRequestError, match="too short"):
            ours.process_item("audio", make_clip(0.1, 30)[:length], {})
    for length in (321, 16000, 123457, 479999, 480000):
        samples = make_clip(length / 16000, 30)[:length]
        processed = ours.process_item("audio", samples, {})
        reference = hf(text="<|AUDIO|>", audio=[samples], sampling_rate=16000, return_tensors="np")
        assert len(processed.replacement) == int((reference["input_ids"] == ctx.hf_config.audio_token_id).sum())
        assert np.array_equal(processed.encoder_inputs["input_features"], reference["input_features"][0])
        assert processed.encoder_inputs["num_frames"] == int(reference["feature_attention_mask"].sum())


def test_encoder_over_the_clip_alone_equals_transformers_masked_encoder(tiny_qwen2_audio_dir):
    """Our encoder runs the layers over the clip's positions only; transformers runs all 1,500
    and masks the keys past the clip. The vectors must agree."""
    import torch
    from transformers import AutoConfig
    from transformers.masking_utils import create_bidirectional_mask

    from vlmd_qwen2_audio.model import Qwen2AudioModel
    from vlmd_qwen2_audio.processing import conv_output_frames, num_audio_tokens

    hf_model, hf = load_hf_qwen2_audio(tiny_qwen2_audio_dir)
    ours = Qwen2AudioModel.load(tiny_qwen2_audio_dir, AutoConfig.from_pretrained(tiny_qwen2_audio_dir), torch.float32)
    clips = [make_clip(seconds, 50 + i) for i, seconds in enumerate((0.05, 1.3, 17.77, 30.0))]
    extracted = hf.feature_extractor(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True,
                                     return_tensors="pt")
    frames = extracted["attention_mask"].sum(-1).tolist()
    inputs = [{"input_features": f.numpy(), "num_frames": n} for f, n in zip(extracted["input_features"], frames)]
    with torch.inference_mode():
        vectors = ours.embed_multimodal("audio", inputs)
        tower = hf_model.model.audio_tower if hasattr(hf_model, "model") else hf_model.audio_tower
        keys = (torch.arange(1500)[None, :] < torch.tensor([conv_output_frames(n) for n in frames])[:, None]).long()
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(clips), 1500, 1),
                                         attention_mask=keys)
        projector = hf_model.model.multi_modal_projector if hasattr(hf_model, "model") else hf_model.multi_modal_projector
        reference = projector(tower(extracted["input_features"], attention_mask=mask).last_hidden_state)
    for index, n in enumerate(frames):
        assert vectors[index].shape[0] == num_audio_tokens(n)
        torch.testing.assert_close(vectors[index], reference[index, : num_audio_tokens(n)], atol=2e-5, rtol=1e-5)


def test_transcription_through_a_decoder_only_model(qwen2_audio_server, tiny_qwen2_audio_dir):
    data = encode(make_clip(6.0, 40), "WAV")
    client = openai.OpenAI(base_url=qwen2_audio_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.audio.transcriptions.create(model="tiny-audio", file=("tone.wav", data, "audio/wav"))
    messages = [{"role": "user", "content": [{"type": "audio", "audio": "clip"},
                                             text("Transcribe the speech in this audio.")]}]
    reference = hf_qwen2_audio_generate(tiny_qwen2_audio_dir, messages, [decoded(data)], 448)
    _, hf = load_hf_qwen2_audio(tiny_qwen2_audio_dir)
    expected = hf.tokenizer.decode(reference["output_token_ids"], skip_special_tokens=True).strip()
    assert result.text == expected and result.text
    with pytest.raises(openai.BadRequestError, match="gives no timestamps"):
        client.audio.transcriptions.create(model="tiny-audio", file=("tone.wav", data), response_format="verbose_json")


def test_http_url_and_mp3_clips(qwen2_audio_server, tiny_qwen2_audio_dir, tmp_path):
    """audio_url over http (the media policy's fetch) and input_audio as mp3 (PyAV)."""
    wav = encode(make_clip(3.3, 60), "WAV")
    (tmp_path / "clip.wav").write_bytes(wav)
    mp3_buffer = io.BytesIO()
    sf.write(mp3_buffer, make_clip(2.2, 61), 16000, format="MP3", subtype="MPEG_LAYER_III")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    clip = {"type": "audio", "audio": "clip"}
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/clip.wav"
        cases = [({"type": "audio_url", "audio_url": {"url": url}}, decoded(wav)),
                 (input_audio(mp3_buffer.getvalue(), "mp3"), decode_audio(mp3_buffer.getvalue(), MediaPolicy()))]
        for part, samples in cases:
            status, body = qwen2_audio_server.chat({**_audio_chat(part), "max_tokens": 6, "temperature": 0,
                                                    "return_token_ids": True})
            assert status == 200, body
            reference = hf_qwen2_audio_generate(tiny_qwen2_audio_dir, [{"role": "user", "content": [
                clip, text("What is it?")]}], [samples], 6)
            assert body["prompt_token_ids"] == reference["prompt_token_ids"]
            assert_greedy_match(body["choices"][0]["token_ids"], reference)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_checkpoint_is_byte_identical_per_seed_and_loads_offline(tiny_qwen2_audio_dir, tmp_path):
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from vlmd.testing.tiny import build_tiny

    again = build_tiny("qwen2_audio", tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_qwen2_audio_dir)
    _, info = Qwen2AudioForConditionalGeneration.from_pretrained(tiny_qwen2_audio_dir, output_loading_info=True)
    assert not any(info.values()), info
    processor = AutoProcessor.from_pretrained(tiny_qwen2_audio_dir)
    assert processor.feature_extractor.feature_size == 128
    tokens = processor.tokenizer.convert_tokens_to_ids(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    assert len(set(tokens)) == 3 and processor.tokenizer.unk_token_id not in tokens


def test_responses_input_audio_equals_chat_and_counts_audio_tokens(qwen2_audio_server):
    """/v1/responses takes input_audio parts as chat does: the same greedy answer, and the
    clip's placeholder tokens in usage per modality on both routes."""
    clip = input_audio(encode(make_clip(2.0, 24), "WAV"), "wav")
    client = openai.OpenAI(base_url=qwen2_audio_server.url + "/v1", api_key="none", max_retries=0)
    response = client.responses.create(
        model=qwen2_audio_server.model, max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": [clip, {"type": "input_text", "text": "What is it?"}]}])
    status, chat = qwen2_audio_server.chat({"messages": [{"role": "user", "content": [clip, text("What is it?")]}],
                                            "max_tokens": 4, "temperature": 0})
    assert status == 200, chat
    assert response.output_text == chat["choices"][0]["message"]["content"]
    audio_tokens = chat["usage"]["prompt_tokens_details"]["multimodal_tokens"]
    assert set(audio_tokens) == {"audio"} and 0 < audio_tokens["audio"] < chat["usage"]["prompt_tokens"]
    assert response.usage.input_tokens_details.model_extra["multimodal_tokens"] == audio_tokens
    # OpenAI's typed spelling of the same count, as the official client reads it.
    reply = client.chat.completions.create(model=qwen2_audio_server.model, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": [clip, text("What is it?")]}])
    assert reply.usage.prompt_tokens_details.audio_tokens == audio_tokens["audio"]
    assert reply.usage.prompt_tokens_details.image_tokens == 0
    assert reply.usage.prompt_tokens_details.text_tokens == chat["usage"]["prompt_tokens"] - audio_tokens["audio"]
