"""Qwen2-Audio processing: 16 kHz clips -> 128-bin log-mel features and ``<|AUDIO|>`` runs.

Features come from the checkpoint's own ``WhisperFeatureExtractor`` (transformers), called as
transformers' ``Qwen2AudioProcessor`` calls it: every clip padded to 30 s (3,000 frames)
before the STFT, the log-mel clamp taken per clip, and an attention mask whose sum is the
clip's frame count. A clip of ``n`` frames becomes ``((n - 1) // 2 + 1 - 2) // 2 + 1``
placeholders (the stride-2 convolution, then the 2x pooling), exactly the processor's count.
Clips longer than 30 s are refused (transformers would cut them silently).

The same processor serves /v1/audio/transcriptions: one window is a chat prompt (the
checkpoint's template) with the clip and a transcription instruction.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ProcessedItem,
)
from vlmd.processing.speech import ChatSpeechToTextProcessor, TranscriptionOptions, checked_clip

INSTRUCTIONS = {
    "transcribe": "Transcribe the speech in this audio.",
    "translate": "Translate the speech in this audio into English.",
}


def conv_output_frames(num_frames: int) -> int:
    """Encoder positions a clip of ``num_frames`` mel frames covers (the stride-2 conv)."""
    return (num_frames - 1) // 2 + 1


def num_audio_tokens(num_frames: int) -> int:
    """Placeholders of a clip: the conv output pooled by 2 (transformers' formula)."""
    return (conv_output_frames(num_frames) - 2) // 2 + 1


def _json(model_dir: str, name: str) -> dict:
    path = Path(model_dir) / name
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


class Qwen2AudioProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        settings = _json(ctx.model_dir, "preprocessor_config.json")
        self.feature_settings = settings.get("feature_extractor", settings)
        self.sampling_rate = int(self.feature_settings.get("sampling_rate", 16000))
        self.max_samples = int(self.feature_settings.get("chunk_length", 30)) * self.sampling_rate
        self.generation = _json(ctx.model_dir, "generation_config.json")

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"audio": None}

    def marker_token_id(self, modality: str) -> int:
        return int(self.ctx.hf_config.audio_token_id)

    def chat_part(self, modality: str) -> dict[str, Any]:
        # The checkpoint's template tests for an "audio" key, not the part's type.
        return {"type": "audio", "audio": "<audio>"}

    @functools.cached_property
    def feature_extractor(self):
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor.from_pretrained(self.ctx.model_dir)


class Qwen2AudioProcessor(BaseMultiModalProcessor, ChatSpeechToTextProcessor):
    speech_tasks = ("transcribe", "translate")
    timestamps = False

    def __init__(self, info: Qwen2AudioProcessingInfo):
        super().__init__(info)
        self.sampling_rate = info.sampling_rate
        self.window_seconds = info.max_samples / info.sampling_rate

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality != "audio":
            raise BadRequestError(f"Qwen2-Audio does not accept {modality} input")
        if kwargs:
            raise BadRequestError(
                f"Qwen2-Audio takes no mm_processor_kwargs (got {sorted(kwargs)})", param="mm_processor_kwargs"
            )
        samples = checked_clip(media, self.info.max_samples, self.sampling_rate)
        extracted = self.info.feature_extractor(
            samples, sampling_rate=self.sampling_rate, padding="max_length", return_attention_mask=True,
            return_tensors="np",
        )
        num_frames = int(extracted["attention_mask"][0].sum())
        count = num_audio_tokens(num_frames)
        if count < 1:  # transformers would give the clip no placeholder at all
            raise BadRequestError(
                f"an audio clip of {samples.shape[0]} samples is too short for this model (it needs more than "
                f"{2 * int(self.info.feature_settings.get('hop_length', 160))} samples at {self.sampling_rate} Hz)",
                param="messages",
            )
        return ProcessedItem(
            encoder_inputs={"input_features": extracted["input_features"][0].astype(np.float32), "num_frames": num_frames},
            replacement=[self.info.marker_token_id("audio")] * count,
        )

    # ---- /v1/audio/transcriptions ---------------------------------------------------

    def speech_instruction(self, options: TranscriptionOptions) -> str:
        instruction = INSTRUCTIONS[options.task]
        if options.prompt:
            instruction += f" Context: {options.prompt.strip()}"
        return instruction


class Qwen2AudioDummyInputsBuilder(BaseDummyInputsBuilder):
    def dummy_item(self, modality: str) -> np.ndarray:
        # The worst case is the longest clip: 30 s, 750 placeholders.
        return np.zeros(self.info.max_samples, dtype=np.float32)
