"""The front end of /v1/audio/transcriptions and /translations, torch-free.

``check`` validates the options against the model (on the event loop, before any work);
``prepare`` decodes the upload and cuts it into windows at quiet points (on the preprocessing
pool). The server then asks the engine to detect the language if the model detects languages,
and turns every window into an engine request with ``engine_request``: the family's
``speech_prompt`` gives the whole generation prompt (ids and items, with or without
placeholders), also on the pool. ``segments`` maps the tokens back to timed segments;
``alignment_query`` and ``words`` time the words of a decoded window (the engine aligns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.media.audio import decode_audio
from vlmd.media.policy import MediaPolicy
from vlmd.processing.audio_windows import split_at_quiet_points
from vlmd.processing.base import ProcessorOutput
from vlmd.processing.speech import (
    TASKS, AlignmentQuery, SpeechToTextProcessor, TimedSegment, TimedWord, TokenConstraints, TranscriptionOptions,
)
from vlmd.types import EngineRequest, SamplingParams

# How far back from a window's end a quiet point is searched for.
QUIET_SEARCH_SECONDS = 5.0


@dataclass
class PreparedWindow:
    index: int
    start: float  # seconds in the upload
    end: float
    samples: np.ndarray  # mono, at the model's rate


@dataclass
class PreparedAudio:
    duration: float
    windows: list[PreparedWindow]


class TranscriptionPreprocessor:
    def __init__(self, processor: SpeechToTextProcessor, policy: MediaPolicy, max_model_len: int):
        self.processor = processor
        self.policy = policy
        self.max_model_len = max_model_len

    @property
    def multilingual(self) -> bool:
        return self.processor.multilingual

    def check(self, options: TranscriptionOptions) -> None:
        if options.task not in TASKS:
            raise BadRequestError(f"task must be one of {list(TASKS)}", param="task")
        if options.task not in self.processor.speech_tasks:
            if options.task == "translate" and not self.multilingual:
                raise BadRequestError(
                    "this model is English-only: it cannot translate; use /v1/audio/transcriptions", param="model"
                )
            raise BadRequestError(
                f"this model cannot {options.task}; it serves {', '.join(self.processor.speech_tasks)}", param="model"
            )
        if options.words and not self.processor.word_timestamps:
            raise BadRequestError(
                "this model cannot time words (its checkpoint names no cross-attention alignment heads): "
                "drop timestamp_granularities[]=word", param="timestamp_granularities",
            )
        if options.timestamps and not self.processor.timestamps:
            raise BadRequestError(
                "this model gives no timestamps; use response_format json or text", param="response_format"
            )
        if options.language is None:
            return
        if not self.multilingual:
            if options.language != "en":
                raise BadRequestError(
                    f"this model transcribes English only, not {options.language!r}", param="language"
                )
        elif options.language not in self.processor.languages():
            known = ", ".join(sorted(self.processor.languages()))
            raise BadRequestError(
                f"language {options.language!r} is not supported; use an ISO-639-1 code: {known}", param="language"
            )

    def prepare(self, data: bytes, options: TranscriptionOptions) -> PreparedAudio:
        """Decode and window an upload (blocking: run on the preprocessing pool)."""
        return self.prepare_samples(decode_audio(data, self.policy, self.processor.sampling_rate))

    def prepare_samples(self, samples: np.ndarray) -> PreparedAudio:
        """Windows of decoded mono samples at the model's rate."""
        rate = self.processor.sampling_rate
        windows = split_at_quiet_points(samples, rate, self.processor.window_seconds, QUIET_SEARCH_SECONDS)
        prepared = []
        for index, window in enumerate(windows):
            start, end = window.seconds(rate)
            prepared.append(PreparedWindow(index, start, end, samples[window.start : window.end]))
        return PreparedAudio(samples.shape[0] / rate, prepared)

    def language_of(self, token_id: int) -> str:
        for code, language_token in self.processor.languages().items():
            if language_token == token_id:
                return code
        raise ValueError(f"token {token_id} is not a language token")

    def window_prompt(self, window: PreparedWindow, options: TranscriptionOptions, language: str | None) -> ProcessorOutput:
        """The family's whole generation prompt for one window (blocking: features are computed)."""
        output = self.processor.speech_prompt(window.samples, options, language if self.multilingual else None)
        if len(output.prompt_token_ids) >= self.max_model_len:
            raise BadRequestError(
                f"the prompt takes {len(output.prompt_token_ids)} tokens; the model holds {self.max_model_len}",
                param="prompt",
            )
        return output

    def token_constraints(self) -> TokenConstraints:
        return self.processor.token_constraints()

    def engine_request(
        self, request_id: str, window: PreparedWindow, options: TranscriptionOptions, language: str | None,
        eos_token_ids: tuple[int, ...], temperature: float = 0.0, logprobs: int | None = None, seed: int | None = None,
    ) -> EngineRequest:
        """One window's decode under the generation config's suppressions (a ``seed`` makes a
        sampled decode reproducible). Blocking: run on the preprocessing pool."""
        output = self.window_prompt(window, options, language)
        return self.decode_request(request_id, output, eos_token_ids, temperature, logprobs, seed)

    def decode_request(
        self, request_id: str, output: ProcessorOutput, eos_token_ids: tuple[int, ...], temperature: float = 0.0,
        logprobs: int | None = None, seed: int | None = None, processed_logprobs: bool = False,
    ) -> EngineRequest:
        """A decode of a window whose prompt (``window_prompt``) is built: cheap, so each
        temperature of a fallback is one more request on the same prompt and features."""
        constraints = self.token_constraints()
        prompt = output.prompt_token_ids
        sampling = SamplingParams(
            max_tokens=self.processor.max_output_tokens(len(prompt), self.max_model_len), temperature=temperature,
            seed=seed, logprobs=logprobs, processed_logprobs=processed_logprobs,
            suppress_token_ids=constraints.suppress_token_ids,
            begin_suppress_token_ids=constraints.begin_suppress_token_ids,
        )
        return EngineRequest(request_id, prompt, sampling, output.items, eos_token_ids=eos_token_ids,
                             arrival_time=time.time(), family_state=output.family_state)

    def no_speech_request(self, request_id: str, output: ProcessorOutput) -> tuple[EngineRequest, int] | None:
        """One step whose (raw) log-prob of the no-speech token gives the window's
        ``no_speech_prob``, with that token; None for a model without one."""
        probe = self.processor.no_speech_probe(output)
        if probe is None:
            return None
        sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, allowed_token_ids=(probe.token_id,))
        request = EngineRequest(request_id, probe.prompt.prompt_token_ids, sampling, probe.prompt.items,
                                arrival_time=time.time(), family_state=probe.prompt.family_state)
        return request, probe.token_id

    def detection_request(self, request_id: str, window: PreparedWindow) -> EngineRequest:
        """One step that picks the likeliest language token (transformers' detect_language)."""
        output = self.processor.detection_prompt(window.samples)
        sampling = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=tuple(self.processor.languages().values()))
        return EngineRequest(request_id, output.prompt_token_ids, sampling, output.items, arrival_time=time.time())

    def segments(self, token_ids: list[int], window: PreparedWindow) -> list[TimedSegment]:
        """The window's segments in seconds from the start of the upload, within the window."""
        length = window.end - window.start
        segments = []
        for segment in self.processor.split_segments(token_ids, length):
            start = window.start + min(max(segment.start, 0.0), length)
            end = window.start + min(max(segment.end, segment.start), length)
            segments.append(TimedSegment(round(start, 3), round(max(end, start), 3), segment.token_ids))
        return segments

    def alignment_query(self, window: PreparedWindow, prompt: ProcessorOutput, token_ids: list[int]) -> AlignmentQuery:
        """What the engine aligns to time the words of ``window``, decoded as ``token_ids``."""
        limit = self.processor.max_output_tokens(len(prompt.prompt_token_ids), self.max_model_len)
        # Fewer tokens than the limit: the decode stopped at the end of text (which was dropped).
        return self.processor.alignment_query(prompt, token_ids, window.samples.shape[0], ended=len(token_ids) < limit)

    def words(self, token_ids: list[int], alignment, window: PreparedWindow, language: str | None) -> list[TimedWord]:
        """The window's words in seconds from the start of the upload, within the window
        (blocking: the time warping runs here, on the preprocessing pool)."""
        length = window.end - window.start
        words = []
        for word in self.processor.split_words(token_ids, alignment, language):
            start = window.start + min(max(word.start, 0.0), length)
            end = window.start + min(max(word.end, word.start, 0.0), length)
            words.append(TimedWord(word.word, round(start, 3), round(max(end, start), 3)))
        return words
