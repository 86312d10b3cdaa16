"""Whisper's processing: a 30 s window becomes log-mel features and one engine item.

The item has no placeholders: it sits at offset 0 with 1,500 encoder vectors, and the
decoder cross-attends to them for the whole request. The decoder prompt follows OpenAI's
format: ``[<|startofprev|> prompt text]`` ``<|startoftranscript|>`` then, on multilingual
models, ``<|lang|> <|task|>``, then ``<|notimestamps|>`` unless timestamps are wanted.
Token constraints come from the checkpoint's generation config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
    ProcessorOutput,
)
from vlmd.processing.speech import (
    AlignmentQuery, NoSpeechProbe, SpeechToTextProcessor, TimedSegment, TimedWord, TokenConstraints,
    TranscriptionOptions,
)
from vlmd.types import KVSpec, MultiModalItem
from vlmd_whisper.features import FeatureSettings, log_mel_features
from vlmd_whisper.word_timing import UNSPACED_LANGUAGES, split_words, token_end_times

TIME_PRECISION = 0.02  # seconds per timestamp step: 30 s / 1,500 encoder frames


def _json(model_dir: str, name: str) -> dict:
    path = Path(model_dir) / name
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


class WhisperProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.generation = _json(ctx.model_dir, "generation_config.json")
        features = _json(ctx.model_dir, "preprocessor_config.json")
        self.feature_settings = FeatureSettings.from_preprocessor_config(features.get("feature_extractor", features))
        for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id"):
            if key not in self.generation:
                raise ValueError(f"the Whisper checkpoint's generation_config.json lacks {key}")

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"audio": 1}

    def marker_token_id(self, modality: str) -> int:
        # Requests built from token lists (the engine's warm-up) mark the audio with the
        # transcript start; the item itself always sits at offset 0.
        return int(self.generation["decoder_start_token_id"])

    def accepts_text_only_prompts(self) -> bool:
        return False  # the decoder transcribes its audio: every request carries one window

    def num_encoder_tokens(self) -> int:
        return int(self.ctx.hf_config.max_source_positions)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """One window (at most 30 s, padded to 30 s): no placeholders, 1,500 encoder vectors."""
        if size.seconds > self.feature_settings.chunk_length:
            raise ValueError(f"a Whisper window is at most {self.feature_settings.chunk_length} s")
        return ItemTokens(replacement=0, placeholders=0, encoder_tokens=self.num_encoder_tokens())

    def max_model_len(self) -> int:
        return int(self.ctx.hf_config.max_target_positions)

    def kv_spec(self) -> KVSpec:
        config = self.ctx.hf_config  # the decoder's self-attention is what the paged cache holds
        heads = int(config.decoder_attention_heads)
        return KVSpec(num_layers=int(config.decoder_layers), num_kv_heads=heads, head_dim=int(config.d_model) // heads,
                      num_cross_layers=int(config.decoder_layers))

    def cross_kv_tokens_per_item(self, modality: str) -> int:
        """Every decoder layer cross-attends to the window's encoder frames (``decoder.py``)."""
        return self.num_encoder_tokens()


class WhisperAudioProcessor(BaseMultiModalProcessor, SpeechToTextProcessor):
    temperature_fallback = True

    def __init__(self, info: WhisperProcessingInfo):
        super().__init__(info)
        generation = info.generation
        self.settings = info.feature_settings
        self.sampling_rate = self.settings.sampling_rate
        self.window_seconds = float(self.settings.chunk_length)
        self.sot = int(generation["decoder_start_token_id"])
        self.eos = int(generation["eos_token_id"])
        self.no_timestamps = int(generation["no_timestamps_token_id"])
        self.timestamp_begin = self.no_timestamps + 1
        self.prev_sot = generation.get("prev_sot_token_id")
        self.tasks = {task: int(token) for task, token in generation.get("task_to_id", {}).items()}
        self._languages = {
            token.strip("<|>"): int(token_id) for token, token_id in generation.get("lang_to_id", {}).items()
        }
        if self._languages and set(self.tasks) != {"transcribe", "translate"}:
            raise ValueError("a multilingual Whisper checkpoint needs task_to_id for transcribe and translate")
        hf_config = info.ctx.hf_config
        self.max_prompt_text_tokens = int(hf_config.max_target_positions) // 2 - 1  # OpenAI's limit
        # Words are timed by the cross-attention of the heads the checkpoint names (alignment.py).
        self.word_timestamps = bool(generation.get("alignment_heads"))

    # ---- engine items --------------------------------------------------------------

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        if modality != "audio":
            raise BadRequestError(f"Whisper does not accept {modality} input")
        samples = np.asarray(media, dtype=np.float32)
        if samples.ndim != 1 or samples.shape[0] > self.settings.window_samples:
            raise ValueError(f"expected at most {self.settings.window_samples} mono samples per window")
        tokens = self.info.item_tokens(modality, ItemSize(seconds=samples.shape[0] / self.sampling_rate), kwargs)
        return ProcessedItem(
            encoder_inputs={"input_features": log_mel_features(samples, self.settings)},
            replacement=[],
            num_placeholders=tokens.placeholders,
            num_encoder_tokens=tokens.encoder_tokens,
        )

    def apply(self, prompt_token_ids: list[int], media: dict[str, list[Any]], kwargs: dict[str, Any] | None = None) -> ProcessorOutput:
        kwargs = {**self.info.ctx.mm_processor_kwargs, **(kwargs or {})}
        audio = media.get("audio", [])
        if len(audio) != 1 or any(items for modality, items in media.items() if modality != "audio"):
            raise BadRequestError("a Whisper request takes exactly one audio window")
        if self.sot not in prompt_token_ids:
            raise BadRequestError("a Whisper decoder prompt must contain <|startoftranscript|>")
        samples = np.ascontiguousarray(audio[0], dtype=np.float32)
        # Hashed as raw bytes: the identifier covers every sample exactly.
        identifier = self.identifier("audio", samples.view(np.uint8), kwargs)
        processed = self._process_cached("audio", identifier, samples, kwargs)
        item = MultiModalItem(
            "audio", identifier, offset=0, length=0, encoder_inputs=processed.encoder_inputs,
            encoder_tokens=processed.num_encoder_tokens,
        )
        return ProcessorOutput(list(prompt_token_ids), [item])

    def speech_prompt(self, samples: np.ndarray, options: TranscriptionOptions, language: str | None) -> ProcessorOutput:
        """The decoder prompt and the window's audio as one item without placeholders."""
        prompt_ids = self.prompt_text_ids(options.prompt) if options.prompt else []
        return self.apply(self.decoder_prompt(options, language, prompt_ids), {"audio": [samples]})

    # ---- prompts and outputs -------------------------------------------------------

    def languages(self) -> dict[str, int]:
        return dict(self._languages)

    @property
    def speech_tasks(self) -> tuple[str, ...]:
        # An English-only checkpoint has no <|translate|> task.
        return ("transcribe", "translate") if self._languages else ("transcribe",)

    def prompt_text_ids(self, text: str) -> list[int]:
        if self.prev_sot is None:
            raise BadRequestError("this checkpoint does not take a prompt (no <|startofprev|> token)", param="prompt")
        tokenizer = self.info.ctx.tokenizer
        # Special-token text in the prompt stays text: a client cannot inject control tokens.
        ids = tokenizer.encode(" " + text.strip(), add_special_tokens=False, split_special_tokens=True)
        return ids[-self.max_prompt_text_tokens :]

    def decoder_prompt(self, options: TranscriptionOptions, language: str | None, prompt_ids: list[int]) -> list[int]:
        prompt = [int(self.prev_sot), *prompt_ids] if prompt_ids else []
        prompt.append(self.sot)
        if self._languages:
            if language not in self._languages:
                raise BadRequestError(f"language {language!r} is not supported", param="language")
            prompt += [self._languages[language], self.tasks[options.task]]
        if not options.timestamps:
            prompt.append(self.no_timestamps)
        return prompt

    def language_name(self, code: str | None) -> str:
        from transformers.models.whisper.tokenization_whisper import LANGUAGES  # no torch import

        code = code or "en"  # English-only models
        return LANGUAGES.get(code, code)

    def detection_prompt(self, samples: np.ndarray) -> ProcessorOutput:
        return self.apply([self.sot], {"audio": [samples]})

    def no_speech_probe(self, window_prompt: ProcessorOutput) -> NoSpeechProbe:
        """<|nospeech|> (the token before <|notimestamps|>, as transformers' WhisperNoSpeechDetection
        takes it) right after <|startoftranscript|>: openai-whisper reads it at that position,
        before the language and task tokens, with the text prompt before it."""
        prompt = window_prompt.prompt_token_ids
        through_sot = prompt[: prompt.index(self.sot) + 1]
        return NoSpeechProbe(ProcessorOutput(through_sot, window_prompt.items), self.no_timestamps - 1)

    def token_constraints(self) -> TokenConstraints:
        generation = self.info.generation
        return TokenConstraints(
            tuple(int(t) for t in generation.get("suppress_tokens") or ()),
            tuple(int(t) for t in generation.get("begin_suppress_tokens") or ()),
        )

    def split_segments(self, token_ids: list[int], window_seconds: float) -> list[TimedSegment]:
        """Text between an opening and a closing timestamp is a segment; text without
        timestamps (or after the last one) runs to the end of the window."""
        segments: list[TimedSegment] = []
        start: float | None = None
        text: list[int] = []
        for token in token_ids:
            if token >= self.timestamp_begin:
                time = (token - self.timestamp_begin) * TIME_PRECISION
                if start is not None and text:
                    segments.append(TimedSegment(start, time, text))
                    start, text = None, []
                else:
                    start = time
            elif token < self.eos:
                text.append(token)
        if text:
            segments.append(TimedSegment(start if start is not None else 0.0, window_seconds, text))
        return segments


    # ---- word timestamps (alignment.py on the engine thread, word_timing.py here) --------

    def alignment_query(self, window_prompt: ProcessorOutput, token_ids: list[int], num_samples: int,
                        ended: bool = True) -> AlignmentQuery:
        """The window's prompt and output fed again, as they were fed while decoding: the last
        token of a decode cut at its length limit never was (transformers then gives it the
        time of the token before; ``split_words`` does too). The encoder frames the samples
        cover: one per two 10 ms mel frames, counted as transformers' attention mask counts."""
        mel_frames = -(-num_samples // self.settings.hop_length)
        prompt = window_prompt.prompt_token_ids
        fed = token_ids if ended else token_ids[:-1]
        return AlignmentQuery(window_prompt.items[0], [*prompt, *fed], len(prompt), mel_frames // 2)

    def split_words(self, token_ids: list[int], alignment, language: str | None) -> list[TimedWord]:
        tokenizer = self.info.ctx.tokenizer
        times = token_end_times(alignment)
        times += [times[-1] if times else 0.0] * (len(token_ids) - len(times))  # a token never fed (above)
        words = split_words(
            token_ids, times, is_text=lambda token: token < self.eos,
            is_timestamp=lambda token: token >= self.timestamp_begin, decode=lambda ids: tokenizer.decode(ids),
            unspaced=(language or "en") in UNSPACED_LANGUAGES,
        )
        return [TimedWord(word.text.strip(), word.start, word.end) for word in words if word.text.strip()]


class WhisperDummyInputsBuilder(BaseDummyInputsBuilder):
    def dummy_item(self, modality: str) -> np.ndarray:
        # Every window is padded to 30 s: any audio is the worst case.
        settings = self.info.feature_settings
        return np.zeros(settings.window_samples, dtype=np.float32)
