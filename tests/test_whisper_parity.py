"""Whisper through the engine (scheduler + runner + our decoder) against transformers' generate.

Greedy tokens must equal transformers' on the same weights and the same samples: the tiny
random multilingual checkpoint (transcribe, translate, timestamps, a text prompt, language
detection) under continuous batching, chunked prefill and preemption, and the real tiny.en.
"""

from __future__ import annotations

import numpy as np
import pytest

from oracle import assert_greedy_match
from vlmd.config import ServeConfig
from vlmd.engine.builder import build_engine
from vlmd.processing.speech import TranscriptionOptions
from conftest import device_under_test
from whisper_support import FOX, hf_whisper_generate, needs_espeak, needs_tiny_en, read_samples, speech_wav


def _tones(index: int, seconds: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * (200 + 700 * index) * t) * np.sin(2 * np.pi * t * (index + 1))).astype(np.float32)


CLIPS = [_tones(0, 3.0), _tones(1, 8.0), _tones(2, 13.0), _tones(3, 29.5)]


def _engine(model_dir, **overrides):
    config = ServeConfig(model=str(model_dir), num_kv_blocks=overrides.pop("num_kv_blocks", 1200), device=device_under_test(),
                         **overrides)
    return build_engine(config)


def _run(built, requests) -> dict[str, list[int]]:
    """Submit all requests at once (continuous batching) and collect each one's tokens."""
    core = built.core
    outputs: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        deltas, _ = core.step()
        for delta in deltas:
            assert delta.error is None, delta.error
            outputs[delta.request_id].extend(delta.new_token_ids)
    eos = set(built.eos_token_ids)
    return {rid: tokens[:-1] if tokens and tokens[-1] in eos else tokens for rid, tokens in outputs.items()}


def _request(built, request_id, samples, options, language):
    transcriber = built.transcriber
    window = transcriber.prepare_samples(samples).windows[0]
    return transcriber.engine_request(request_id, window, options, language, built.eos_token_ids)


def _reference(model_dir, samples, options, language):
    kwargs = {"return_timestamps": options.timestamps}
    if language is not None:
        kwargs.update(language=language, task=options.task)
    if options.prompt:
        import torch

        from whisper_support import load_hf_whisper

        _, processor = load_hf_whisper(str(model_dir.resolve()))
        kwargs["prompt_ids"] = torch.tensor(processor.tokenizer.get_prompt_ids(options.prompt))
    return hf_whisper_generate(model_dir, samples, **kwargs)


CASES = [
    (TranscriptionOptions(), "en"),
    (TranscriptionOptions(timestamps=True), "en"),
    (TranscriptionOptions(task="translate"), "fr"),
    (TranscriptionOptions(task="translate", timestamps=True), "de"),
    (TranscriptionOptions(prompt="Glossary: vlmd, paged attention."), "es"),
]


@pytest.mark.parametrize(
    "regime",
    [
        {},
        {"max_num_batched_tokens": 3},  # prompts split across steps (chunked prefill)
        # 290 blocks of 16 for 20 requests, each 94 of cross-attention K/V and up to 4 of text:
        # three get in, then grow past what is left.
        {"num_kv_blocks": 290, "max_num_seqs": 8},
        # The audio has no placeholders: a step budget below its 1,500 vectors is no obstacle.
        {"disable_chunked_mm_input": True, "max_num_batched_tokens": 8},
    ],
    ids=["batched", "chunked-prefill", "preemption", "unchunked-mm-small-budget"],
)
def test_tiny_whisper_matches_transformers(tiny_whisper_dir, regime):
    built = _engine(tiny_whisper_dir, **regime)
    requests, references = [], {}
    for case_index, (options, language) in enumerate(CASES):
        for clip_index, samples in enumerate(CLIPS):
            request_id = f"case{case_index}-clip{clip_index}"
            requests.append(_request(built, request_id, samples, options, language))
            references[request_id] = _reference(tiny_whisper_dir, samples, options, language)
    outputs = _run(built, requests)
    for request_id, reference in references.items():
        assert_greedy_match(outputs[request_id], reference)
    if "num_kv_blocks" in regime:
        assert built.core.scheduler.num_preemptions > 0
    # Each window held its whole cross-attention table (1,500 frames: 94 blocks of 16) from the
    # one pool, and every request's blocks, a preempted one's included, are back (D93, D95).
    stats = built.core.stats()
    self_attention, cross = stats.kv_groups
    assert (cross["kind"], cross["peak_request_blocks"], cross["used_blocks"]) == ("cross_attention", 94, 0)
    assert self_attention["used_blocks"] == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_language_detection_matches_transformers(tiny_whisper_dir):
    import torch

    from oracle import on_oracle_device
    from whisper_support import load_hf_whisper

    built = _engine(tiny_whisper_dir)
    transcriber = built.transcriber
    model, processor = load_hf_whisper(str(tiny_whisper_dir.resolve()))
    device = on_oracle_device(model)
    requests = [transcriber.detection_request(f"d{i}", transcriber.prepare_samples(clip).windows[0])
                for i, clip in enumerate(CLIPS)]
    outputs = _run(built, requests)
    features = processor([clip for clip in CLIPS], sampling_rate=16000, return_tensors="pt").input_features
    features = features.to(device)
    with torch.inference_mode():
        expected = model.detect_language(features).tolist()
    assert [outputs[f"d{i}"][0] for i in range(len(CLIPS))] == expected
    assert all(transcriber.language_of(token) in transcriber.processor.languages() for token in expected)


@needs_tiny_en
@needs_espeak
@pytest.mark.parametrize("timestamps", [False, True])
def test_tiny_en_matches_transformers_on_speech(tiny_en_dir, timestamps):
    built = _engine(tiny_en_dir)
    samples = read_samples(speech_wav(FOX))
    options = TranscriptionOptions(timestamps=timestamps)
    outputs = _run(built, [_request(built, "fox", samples, options, None)])
    reference = _reference(tiny_en_dir, samples, options, None)
    assert outputs["fox"] == reference["output_token_ids"]
    text = built.tokenizer.decode(outputs["fox"], skip_special_tokens=True)
    assert "quick brown fox" in text.lower()
    if timestamps:
        segments = built.transcriber.segments(outputs["fox"], built.transcriber.prepare_samples(samples).windows[0])
        assert segments and 0 <= segments[0].start < segments[-1].end <= len(samples) / 16000 + 0.02


def test_every_whisper_product_is_on_the_linear_seam(tiny_whisper_dir):
    """Encoder linears and the tied output projection are selected like the decoder's, and
    packed kernels give the plain products' results to float rounding."""
    import torch
    from torch import nn
    from transformers import AutoConfig

    from vlmd.layers.linear import LinearBase, select_linear_kernels
    from vlmd_whisper.model import WhisperModel

    config = AutoConfig.from_pretrained(tiny_whisper_dir)
    plain = WhisperModel.load(tiny_whisper_dir, config, torch.float32)
    packed = WhisperModel.load(tiny_whisper_dir, config, torch.float32)
    assert not [name for name, m in packed.named_modules() if type(m) is nn.Linear]
    decoder = packed.decoder
    assert isinstance(decoder.proj_out, LinearBase)
    assert decoder.proj_out.weight is decoder.embed_tokens.weight  # tied: one tensor
    select_linear_kernels(packed, "packed")
    assert decoder.embed_tokens.weight is not None  # the lookups still have their table
    assert all(m.kernel is not None for m in packed.modules() if isinstance(m, LinearBase))

    features = np.random.default_rng(0).standard_normal((config.num_mel_bins, plain.num_frames)).astype(np.float32)
    with torch.inference_mode():
        encoded = [m.embed_multimodal("audio", [{"input_features": features}])[0] for m in (plain, packed)]
        torch.testing.assert_close(encoded[1], encoded[0], rtol=1e-4, atol=1e-4)
        hidden = torch.randn(3, config.d_model)
        torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-4, atol=1e-4)
