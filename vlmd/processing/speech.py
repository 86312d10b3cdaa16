"""What /v1/audio/transcriptions and /v1/audio/translations need from a family's processor.

A speech-to-text family's processor (a ``BaseMultiModalProcessor``) also implements
``SpeechToTextProcessor``. The one thing it must say is how a window of audio becomes a
whole generation prompt: ``speech_prompt`` returns a ``ProcessorOutput`` (prompt ids and
items), whatever the model's shape. An encoder-decoder (Whisper) gives a decoder prompt of
control tokens and one item without placeholders; a decoder-only audio LM (Qwen2-Audio) gives
a chat prompt whose audio placeholders its encoder fills. Optional parts: the languages it
detects, the token constraints of its generation config, how its output carries
timestamps, and how its words are timed. The generic pipeline (decode, windowing, language
detection, joining) lives in ``vlmd/processing/transcription.py`` and ``vlmd/server/audio.py``
and names no family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vlmd.errors import BadRequestError

if TYPE_CHECKING:
    from vlmd.processing.base import ProcessorOutput
    from vlmd.types import MultiModalItem

TASKS = ("transcribe", "translate")
# Output tokens per transcription window of a chat-template model whose generation config names
# no limit: Whisper's decoder length, ample for 30 s of speech, and a bound on a model that never
# ends its turn.
DEFAULT_WINDOW_TOKENS = 448


@dataclass(frozen=True)
class TranscriptionOptions:
    task: str = "transcribe"  # or "translate" (into English)
    language: str | None = None  # ISO-639-1 code; None: the model's only language, or detected
    prompt: str | None = None  # text that conditions the decoder (spelling, style)
    timestamps: bool = False  # segment timestamps (verbose_json, srt, vtt)
    words: bool = False  # word timestamps (verbose_json with timestamp_granularities[]=word)


@dataclass
class TimedSegment:
    """Output tokens of one window between two timestamps, in seconds from the window start."""

    start: float
    end: float
    token_ids: list[int]


@dataclass(frozen=True)
class TimedWord:
    """One word of the output, in seconds from the window start."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class AlignmentQuery:
    """What the engine aligns for one window after its decode (``AsyncEngine.align``): the
    window's item, the tokens fed to the decoder (its prompt, then the output), where the
    output starts, and how many encoder frames the audio covers (the rest is padding)."""

    item: MultiModalItem
    token_ids: list[int]
    first_row: int
    num_frames: int


@dataclass(frozen=True)
class NoSpeechProbe:
    """Where a model says "no speech here": the probability of ``token_id`` as the next token
    after ``prompt`` (Whisper: the window's prompt through <|startoftranscript|>)."""

    prompt: ProcessorOutput
    token_id: int


@dataclass(frozen=True)
class TokenConstraints:
    suppress_token_ids: tuple[int, ...] = ()
    begin_suppress_token_ids: tuple[int, ...] = ()


class SpeechToTextProcessor(ABC):
    """The speech-to-text side of a family processor (see the module docstring)."""

    sampling_rate: int = 16000
    window_seconds: float = 30.0
    speech_tasks: tuple[str, ...] = TASKS  # the tasks this model serves
    timestamps: bool = True  # whether its output can carry segment timestamps
    # Whether windows are judged and re-decoded at higher temperatures (needs no_speech_probe).
    temperature_fallback: bool = False
    # Whether words can be timed (the model aligns output tokens to audio frames: needs
    # alignment_query, split_words and the model's align_tokens).
    word_timestamps: bool = False

    @abstractmethod
    def speech_prompt(self, samples: np.ndarray, options: TranscriptionOptions, language: str | None) -> ProcessorOutput:
        """The whole generation prompt for one window of mono samples (at most
        ``window_seconds``); ``language`` is None unless the model is multilingual."""

    def languages(self) -> dict[str, int]:
        """Language code -> language token for a model that detects languages; {} otherwise."""
        return {}

    @property
    def multilingual(self) -> bool:
        return bool(self.languages())

    def detection_prompt(self, samples: np.ndarray) -> ProcessorOutput:
        """The prompt whose next token, restricted to ``languages()``, names the spoken language."""
        raise NotImplementedError("this model does not detect languages")

    def no_speech_probe(self, window_prompt: ProcessorOutput) -> NoSpeechProbe | None:
        """How to read this model's no-speech probability for a window whose whole prompt is
        ``window_prompt``; None for a model without one (then no temperature fallback)."""
        return None

    def token_constraints(self) -> TokenConstraints:
        """Tokens the generation config forbids (always / as the first output token)."""
        return TokenConstraints()

    def max_output_tokens(self, prompt_length: int, max_model_len: int) -> int:
        """The most tokens one window may generate (default: the rest of the context)."""
        return max_model_len - prompt_length

    def language_name(self, code: str | None) -> str:
        """How responses name the language (OpenAI's verbose_json says "english")."""
        return code or ""

    def split_segments(self, token_ids: list[int], window_seconds: float) -> list[TimedSegment]:
        """Split one window's output at its timestamp tokens (one segment if it has none)."""
        return [TimedSegment(0.0, window_seconds, list(token_ids))] if token_ids else []

    def alignment_query(self, window_prompt: ProcessorOutput, token_ids: list[int], num_samples: int,
                        ended: bool = True) -> AlignmentQuery:
        """The alignment to ask the engine for, after a window of ``num_samples`` samples whose
        whole prompt is ``window_prompt`` decoded ``token_ids`` (end of text dropped; ``ended``
        False: the decode was cut at its length limit instead)."""
        raise NotImplementedError("this model does not time words")

    def split_words(self, token_ids: list[int], alignment, language: str | None) -> list[TimedWord]:
        """The words of one window's output ``token_ids``, timed by ``alignment`` (what the
        engine's ``align`` returned for ``alignment_query``), in seconds from the window start."""
        raise NotImplementedError("this model does not time words")


def checked_clip(media, max_samples: int, sampling_rate: int) -> np.ndarray:
    """A decoded clip in chat as float32 mono samples, or a 400: no samples, not mono, or
    longer than the model takes (``max_samples``)."""
    samples = np.asarray(media, dtype=np.float32)
    if samples.ndim != 1 or samples.shape[0] == 0:
        raise BadRequestError("an audio clip must decode to one or more mono samples", param="messages")
    if samples.shape[0] > max_samples:
        raise BadRequestError(
            f"an audio clip is {samples.shape[0] / sampling_rate:.1f} s long; this model takes at most "
            f"{max_samples / sampling_rate:g} s per clip", param="messages")
    return samples


class ChatSpeechToTextProcessor(SpeechToTextProcessor):
    """A decoder-only audio LM's transcription (Qwen2-Audio, Gemma 4): a window is one user turn
    of the checkpoint's chat template, the clip then the family's ``speech_instruction``, and
    generates at most the generation config's ``max_new_tokens`` (else
    ``DEFAULT_WINDOW_TOKENS``). Mixed into a ``BaseMultiModalProcessor`` whose info reads the
    generation config into ``generation``."""

    @abstractmethod
    def speech_instruction(self, options: TranscriptionOptions) -> str:
        """The text after the clip: what to do with it."""

    def speech_prompt(self, samples: np.ndarray, options: TranscriptionOptions, language: str | None) -> ProcessorOutput:
        info = self.info
        messages = [{"role": "user", "content": [info.chat_part("audio"),
                                                 {"type": "text", "text": self.speech_instruction(options)}]}]
        tokenizer = info.ctx.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.apply(tokenizer.encode(text, add_special_tokens=False), {"audio": [samples]})

    def max_output_tokens(self, prompt_length: int, max_model_len: int) -> int:
        limit = int(self.info.generation.get("max_new_tokens") or DEFAULT_WINDOW_TOKENS)
        return max(1, min(limit, max_model_len - prompt_length))
