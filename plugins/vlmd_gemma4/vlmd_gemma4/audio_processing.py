"""Gemma 4 audio (E2B / E4B): clips in chat and /v1/audio/transcriptions, torch-free.

A clip is 16 kHz mono samples, at most 30 s (``audio_seq_length`` x ``audio_ms_per_token``:
750 soft tokens of 40 ms; transformers' feature extractor cuts anything longer silently, so a
longer clip in chat is a 400 and a longer upload is cut into windows by the transcription
pipeline). Its features come from transformers' own ``Gemma4AudioFeatureExtractor`` (numpy
only: a semicausal STFT, a 128-bin HTK mel bank, log with a floor; it imports neither torch,
torchaudio nor torchvision), called on the clip alone as the processor calls it; only its
valid frames go to the tower (``audio.py`` says why that is the same result). The chat
template leaves ``<|audio|>`` per clip; transformers' processor replaces it with ``<|audio>``
+ n x ``<|audio|>`` + ``<audio|>`` (``replace_audio_token``), n the valid frames after two
stride-2 subsamplings: ``soft_tokens`` here, from the length alone, so `vlmd cost` and the
server agree (25 tokens a second).

Transcription: one window is the chat prompt of the clip followed by the transcription
instruction of Gemma 4's model card (``transcription_instruction``). The model gives no
timestamps, so a verbose_json / srt / vtt answer has one segment per window, spanning it.
Translation is refused: the card's translation prompt answers with the transcript, a newline,
``"{target}: "`` and the translation, which OpenAI's endpoint (English text only) would need
parsed out of free text (docs/decisions.md D113).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.processing.base import ItemSize, ItemTokens, ProcessedItem
from vlmd.processing.speech import ChatSpeechToTextProcessor, TranscriptionOptions, checked_clip
from vlmd_gemma4.processing import Gemma4DummyInputsBuilder, Gemma4ProcessingInfo, Gemma4Processor

LANGUAGE_NAMES = {"en": "English"}


def transcription_instruction(language: str | None) -> str:
    """The ASR prompt of the Gemma 4 model card (google/gemma-4-E2B-it, "Audio": "Transcribe the
    following speech segment in {LANGUAGE} into {LANGUAGE} text." and its formatting rules; see
    also ai.google.dev/gemma/docs/capabilities/audio), placed after the audio as the card's
    examples place it; without a language, "in its original language"."""
    spoken = f"in {LANGUAGE_NAMES[language]} into {LANGUAGE_NAMES[language]} text" if language else "in its original language"
    return (f"Transcribe the following speech segment {spoken}.\n\n"
            "Follow these specific instructions for formatting the answer:\n"
            "* Only output the transcription, with no newlines.\n"
            "* When transcribing numbers, write the digits, i.e. write 1.7 and not one point seven, "
            "and write 3 instead of three.")


class AudioSettings:
    """The checkpoint's feature extractor settings (``processor_config.json``'s
    ``feature_extractor``, else ``preprocessor_config.json`` if it is the feature extractor's)
    and the processor's audio bounds, with transformers' defaults."""

    def __init__(self, model_dir: str):
        raw, processor = {}, {}
        path = Path(model_dir) / "processor_config.json"
        if path.exists():
            processor = json.loads(path.read_text(encoding="utf-8"))
            raw = processor.get("feature_extractor", {})
        preprocessor = Path(model_dir) / "preprocessor_config.json"
        if not raw and preprocessor.exists():
            data = json.loads(preprocessor.read_text(encoding="utf-8"))
            if data.get("feature_extractor_type") == "Gemma4AudioFeatureExtractor":
                raw = data
        self.feature_settings = {key: value for key, value in raw.items()
                                 if key not in ("feature_extractor_type", "processor_class")}
        self.sampling_rate = int(raw.get("sampling_rate", 16000))
        self.frame_length = int(round(self.sampling_rate * float(raw.get("frame_length_ms", 20.0)) / 1000))
        self.hop_length = int(round(self.sampling_rate * float(raw.get("hop_length_ms", 10.0)) / 1000))
        max_tokens = int(processor.get("audio_seq_length", 750))
        ms_per_token = int(processor.get("audio_ms_per_token", 40))
        self.max_samples = max_tokens * ms_per_token * self.sampling_rate // 1000

    def valid_frames(self, num_samples: int) -> int:
        """Mel frames of a clip whose window lies wholly in the clip: the extractor pads
        ``frame_length // 2`` zeros before it, and a frame of ``frame_length + 1`` samples every
        ``hop_length`` is valid where its last sample is the clip's."""
        reach = self.frame_length // 2 + num_samples - 1 - self.frame_length
        return reach // self.hop_length + 1 if reach >= 0 else 0

    def soft_tokens(self, num_samples: int) -> int:
        """Soft tokens of a clip: its valid frames after two stride-2 subsamplings (each keeps
        every other frame: transformers' ``mask[::2]``, twice)."""
        frames = self.valid_frames(num_samples)
        for _ in range(2):
            frames = (frames + 1) // 2
        return frames


class Gemma4AudioProcessingInfo(Gemma4ProcessingInfo):
    """Gemma 4's info with audio where the config has an ``audio_config``."""

    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.hf_config
        self.has_audio = config.audio_config is not None
        self.audio_token_id = int(config.audio_token_id)
        self.boa_token_id = int(config.boa_token_id)
        self.eoa_token_id = int(config.eoa_token_index)
        self.audio = AudioSettings(ctx.model_dir)
        self.generation = {}
        path = Path(ctx.model_dir) / "generation_config.json"
        if path.exists():
            self.generation = json.loads(path.read_text(encoding="utf-8"))

    def supported_mm_limits(self) -> dict[str, int | None]:
        limits = super().supported_mm_limits()
        return {**limits, "audio": None} if self.has_audio else limits

    def marker_token_id(self, modality: str) -> int:
        return self.audio_token_id if modality == "audio" else super().marker_token_id(modality)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An audio clip: ``<|audio>``, its soft tokens, ``<audio|>``."""
        if modality != "audio":
            return super().item_tokens(modality, size, kwargs)
        tokens = self.audio.soft_tokens(int(round(size.seconds * self.audio.sampling_rate)))
        return ItemTokens(replacement=tokens + 2, placeholders=tokens, encoder_tokens=tokens)

    @functools.cached_property
    def feature_extractor(self):
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        return Gemma4AudioFeatureExtractor(**self.audio.feature_settings)


class Gemma4AudioProcessor(Gemma4Processor, ChatSpeechToTextProcessor):
    """Gemma 4's processor where the checkpoint has an audio tower: clips in chat, and
    /v1/audio/transcriptions (``gemma4_processor`` picks it)."""

    speech_tasks = ("transcribe",)
    timestamps = True  # one segment per window (module docstring)

    def __init__(self, info: Gemma4AudioProcessingInfo):
        super().__init__(info)
        self.sampling_rate = info.audio.sampling_rate
        self.window_seconds = info.audio.max_samples / info.audio.sampling_rate

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality != "audio":
            return super().process_item(modality, media, kwargs)
        info: Gemma4AudioProcessingInfo = self.info
        samples = checked_clip(media, info.audio.max_samples, self.sampling_rate)
        tokens = info.item_tokens("audio", ItemSize(seconds=samples.shape[0] / self.sampling_rate), kwargs).placeholders
        if tokens < 1:
            raise BadRequestError(
                f"an audio clip of {samples.shape[0]} samples is too short for this model (it needs at least "
                f"{info.audio.frame_length // 2 + 1} samples at {self.sampling_rate} Hz)", param="messages")
        extracted = info.feature_extractor([samples], return_tensors="np")  # a batch of one, as the processor calls it
        valid = int(extracted["input_features_mask"][0].sum())
        return ProcessedItem(
            encoder_inputs={"input_features": np.ascontiguousarray(extracted["input_features"][0, :valid], dtype=np.float32)},
            replacement=[info.boa_token_id, *[info.audio_token_id] * tokens, info.eoa_token_id],
            placeholder_offset=1, num_placeholders=tokens,
        )

    # ---- /v1/audio/transcriptions ---------------------------------------------------

    def speech_instruction(self, options: TranscriptionOptions) -> str:
        instruction = transcription_instruction(options.language)
        if options.prompt:  # as Qwen2-Audio's: the card has no place for context, so it follows
            instruction += f"\nContext: {options.prompt.strip()}"
        return instruction


def gemma4_processor(info: Gemma4AudioProcessingInfo) -> Gemma4Processor:
    """The family's processor: a speech-to-text one (its type declares it) only where the
    checkpoint has an audio tower."""
    return Gemma4AudioProcessor(info) if info.has_audio else Gemma4Processor(info)


class Gemma4AudioDummyInputsBuilder(Gemma4DummyInputsBuilder):
    def dummy_item(self, modality: str) -> Any:
        if modality != "audio":
            return super().dummy_item(modality)
        return np.zeros(self.info.audio.max_samples, dtype=np.float32)  # the longest clip: 750 tokens
