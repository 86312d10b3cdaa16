"""Whisper's temperature fallback: how good one window's decode is, and whether to decode again.

openai-whisper's ``transcribe`` (and transformers' ``generate`` when ``temperature`` is a
tuple) decode each 30 s window greedily first; a decode that looks wrong is thrown away and
the window decoded again at the next temperature of a ladder (0.0, 0.2, ..., 1.0):
- too repetitive: the zlib compression ratio of its text is above
  ``compression_ratio_threshold`` (2.4);
- too unsure: its average log-probability is below ``logprob_threshold`` (-1.0);
- unless it is silence: the probability of the no-speech token is above
  ``no_speech_threshold`` (0.6) *and* the log-probability is low; such a window is not
  decoded again and contributes no text (openai-whisper skips it).
The last decode of the ladder is kept whatever it looks like. Figures are computed as
openai-whisper computes them (``DecodingResult``): the average log-probability sums the
processed log-probs of every sampled token including the end of text, over (tokens + 1);
the compression ratio is of the window's text (timestamps dropped, stripped), in bytes.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

# openai-whisper's transcribe() defaults; transformers' generate takes the same as arguments.
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COMPRESSION_RATIO_THRESHOLD = 2.4
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6


@dataclass(frozen=True)
class FallbackThresholds:
    """None turns a test off, as in openai-whisper."""

    compression_ratio: float | None = COMPRESSION_RATIO_THRESHOLD
    logprob: float | None = LOGPROB_THRESHOLD
    no_speech: float | None = NO_SPEECH_THRESHOLD


def temperature_ladder(temperature: float) -> tuple[float, ...]:
    """OpenAI's API: temperature 0 lets the server raise the temperature until the thresholds
    are met; any other value is the one temperature the client asked for."""
    return FALLBACK_TEMPERATURES if temperature == 0.0 else (temperature,)


def compression_ratio(text: str) -> float:
    """Bytes of ``text`` over their zlib-compressed size (openai-whisper's measure of repetition)."""
    encoded = text.encode("utf-8")
    return len(encoded) / len(zlib.compress(encoded))


@dataclass
class WindowDecode:
    """One decode of one window."""

    tokens: list[int]  # the output, end of text dropped
    logprobs: list[float]  # processed log-prob of every sampled token, the end of text included
    temperature: float
    text: str  # the window's text (timestamps dropped), stripped
    no_speech_prob: float | None = None  # None: the model has no no-speech token
    attempts: int = 1  # decodes this window took (1 + the fallbacks)

    @property
    def avg_logprob(self) -> float:
        return sum(self.logprobs) / (len(self.tokens) + 1)

    @property
    def compression_ratio(self) -> float:
        return compression_ratio(self.text)

    def is_silence(self, thresholds: FallbackThresholds) -> bool:
        """openai-whisper's skip: likely no speech, and not decoded with confidence."""
        if thresholds.no_speech is None or self.no_speech_prob is None:
            return False
        if self.no_speech_prob <= thresholds.no_speech:
            return False
        return thresholds.logprob is None or not self.avg_logprob > thresholds.logprob

    def needs_fallback(self, thresholds: FallbackThresholds) -> bool:
        failed = (
            (thresholds.compression_ratio is not None and self.compression_ratio > thresholds.compression_ratio)
            or (thresholds.logprob is not None and self.avg_logprob < thresholds.logprob)
        )
        silent = (
            thresholds.no_speech is not None and self.no_speech_prob is not None
            and self.no_speech_prob > thresholds.no_speech
            and thresholds.logprob is not None and self.avg_logprob < thresholds.logprob
        )
        return failed and not silent
