"""The front end of /v1/audio/transcriptions and /translations, torch-free.

``check`` validates the options against the model (on the event loop, before any work);
``prepare`` decodes the upload, cuts it into windows at quiet points and computes each
window's encoder inputs (on the preprocessing pool). The server then asks the engine to
detect the language if needed, builds one decoder prompt per window with ``window_prompt``
and maps the tokens back to timed segments with ``segments``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vlmd.errors import BadRequestError
from vlmd.media.audio import decode_audio
from vlmd.media.policy import MediaPolicy
from vlmd.processing.audio_windows import split_at_quiet_points
from vlmd.processing.speech import TASKS, SpeechToTextProcessor, TimedSegment, TokenConstraints, TranscriptionOptions
from vlmd.types import EngineRequest, MultiModalItem, SamplingParams

# How far back from a window's end a quiet point is searched for.
QUIET_SEARCH_SECONDS = 5.0


@dataclass
class PreparedWindow:
    index: int
    start: float  # seconds in the upload
    end: float
    item: MultiModalItem


@dataclass
class PreparedAudio:
    duration: float
    windows: list[PreparedWindow]
    prompt_ids: list[int]  # the client's prompt text, tokenized (empty without one)


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
        if options.task == "translate" and not self.multilingual:
            raise BadRequestError(
                "this model is English-only: it cannot translate; use /v1/audio/transcriptions", param="model"
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
        """Decode, window and featurize an upload (blocking: run on the preprocessing pool)."""
        samples = decode_audio(data, self.policy, self.processor.sampling_rate)
        prepared = self.prepare_samples(samples)
        if options.prompt:
            prepared.prompt_ids = self.processor.prompt_text_ids(options.prompt)
        return prepared

    def prepare_samples(self, samples: np.ndarray) -> PreparedAudio:
        """Windows of decoded mono samples at the model's rate, with their engine items."""
        rate = self.processor.sampling_rate
        windows = split_at_quiet_points(samples, rate, self.processor.window_seconds, QUIET_SEARCH_SECONDS)
        prepared = []
        for index, window in enumerate(windows):
            start, end = window.seconds(rate)
            item = self.processor.window_item(samples[window.start : window.end])
            prepared.append(PreparedWindow(index, start, end, item))
        return PreparedAudio(samples.shape[0] / rate, prepared, [])

    def detection_prompt(self) -> tuple[list[int], tuple[int, ...]]:
        """The language-detection prompt and the tokens its one output may take."""
        return self.processor.detection_prompt(), tuple(self.processor.languages().values())

    def language_of(self, token_id: int) -> str:
        for code, language_token in self.processor.languages().items():
            if language_token == token_id:
                return code
        raise ValueError(f"token {token_id} is not a language token")

    def window_prompt(self, options: TranscriptionOptions, language: str | None, prompt_ids: list[int]) -> list[int]:
        prompt = self.processor.decoder_prompt(options, language if self.multilingual else None, prompt_ids)
        if len(prompt) >= self.max_model_len:
            raise BadRequestError(
                f"the prompt takes {len(prompt)} tokens; the model's decoder holds {self.max_model_len}",
                param="prompt",
            )
        return prompt

    def token_constraints(self) -> TokenConstraints:
        return self.processor.token_constraints()

    def engine_request(
        self, request_id: str, window: PreparedWindow, prompt: list[int], eos_token_ids: tuple[int, ...],
        temperature: float = 0.0, logprobs: int | None = None, seed: int | None = None,
    ) -> EngineRequest:
        """One window's decode: up to the decoder's length, under the generation config's
        suppressions (a ``seed`` makes a sampled decode reproducible)."""
        constraints = self.token_constraints()
        sampling = SamplingParams(
            max_tokens=self.max_model_len - len(prompt), temperature=temperature, seed=seed, logprobs=logprobs,
            suppress_token_ids=constraints.suppress_token_ids,
            begin_suppress_token_ids=constraints.begin_suppress_token_ids,
        )
        return EngineRequest(request_id, prompt, sampling, [window.item], eos_token_ids=eos_token_ids,
                             arrival_time=time.time())

    def detection_request(self, request_id: str, window: PreparedWindow) -> EngineRequest:
        """One step that picks the likeliest language token (transformers' detect_language)."""
        prompt, languages = self.detection_prompt()
        sampling = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=languages)
        return EngineRequest(request_id, prompt, sampling, [window.item], arrival_time=time.time())

    def segments(self, token_ids: list[int], window: PreparedWindow) -> list[TimedSegment]:
        """The window's segments in seconds from the start of the upload, within the window."""
        length = window.end - window.start
        segments = []
        for segment in self.processor.split_segments(token_ids, length):
            start = window.start + min(max(segment.start, 0.0), length)
            end = window.start + min(max(segment.end, segment.start), length)
            segments.append(TimedSegment(round(start, 3), round(max(end, start), 3), segment.token_ids))
        return segments
