"""What /v1/audio/transcriptions and /v1/audio/translations need from a family's processor.

A speech-to-text family's processor (a ``BaseMultiModalProcessor``) also implements
``SpeechToTextProcessor``: the window length and sampling rate its encoder takes, how to
turn a window into an engine item, the decoder prompt for a task and language, the token
constraints of its generation config, and how its output tokens carry timestamps. The
generic pipeline (decode, windowing, language detection, joining) lives in
``vlmd/processing/transcription.py`` and ``vlmd/server/audio.py`` and names no family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from vlmd.types import MultiModalItem

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class TranscriptionOptions:
    task: str = "transcribe"  # or "translate" (into English)
    language: str | None = None  # ISO-639-1 code; None: the model's only language, or detected
    prompt: str | None = None  # text that conditions the decoder (spelling, style)
    timestamps: bool = False  # segment timestamps (verbose_json, srt, vtt)


@dataclass
class TimedSegment:
    """Output tokens of one window between two timestamps, in seconds from the window start."""

    start: float
    end: float
    token_ids: list[int]


@dataclass(frozen=True)
class TokenConstraints:
    suppress_token_ids: tuple[int, ...] = ()
    begin_suppress_token_ids: tuple[int, ...] = ()


class SpeechToTextProcessor(ABC):
    """The speech-to-text side of a family processor (see the module docstring)."""

    sampling_rate: int = 16000
    window_seconds: float = 30.0

    @abstractmethod
    def window_item(self, samples: np.ndarray) -> MultiModalItem:
        """One window of mono samples (at most ``window_seconds``) as an engine item."""

    @abstractmethod
    def languages(self) -> dict[str, int]:
        """Language code -> language token for a multilingual model; {} for an English-only one."""

    @property
    def multilingual(self) -> bool:
        return bool(self.languages())

    @abstractmethod
    def prompt_text_ids(self, text: str) -> list[int]:
        """Token ids of a client's prompt text (no special tokens, truncated to the model's limit)."""

    @abstractmethod
    def decoder_prompt(self, options: TranscriptionOptions, language: str | None, prompt_ids: list[int]) -> list[int]:
        """The decoder's prompt for one window; ``language`` is None for English-only models."""

    @abstractmethod
    def detection_prompt(self) -> list[int]:
        """The prompt whose next token, restricted to ``languages()``, names the spoken language."""

    @abstractmethod
    def token_constraints(self) -> TokenConstraints:
        """Tokens the generation config forbids (always / as the first output token)."""

    def language_name(self, code: str | None) -> str:
        """How responses name the language (OpenAI's verbose_json says "english")."""
        return code or ""

    @abstractmethod
    def split_segments(self, token_ids: list[int], window_seconds: float) -> list[TimedSegment]:
        """Split one window's output at its timestamp tokens (one segment if it has none)."""
