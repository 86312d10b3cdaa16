"""Transcription response bodies: json, text, srt, vtt and verbose_json (OpenAI's shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson


@dataclass
class Segment:
    start: float  # seconds from the start of the upload
    end: float
    text: str
    token_ids: list[int]
    seek: int  # the window's start, in 10 ms mel frames (OpenAI's "seek")
    # Of the window's kept decode, shared by its segments as in openai-whisper
    # (processing/temperature_fallback.py says how each is computed).
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None = None

    def body(self, index: int) -> dict:
        body = {
            "id": index,
            "seek": self.seek,
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "tokens": self.token_ids,
            "temperature": self.temperature,
            "avg_logprob": self.avg_logprob,
            "compression_ratio": self.compression_ratio,
        }
        if self.no_speech_prob is not None:
            body["no_speech_prob"] = self.no_speech_prob
        return body


def join_texts(texts: list[str]) -> str:
    """Window (or segment) texts joined with single spaces, each stripped."""
    return " ".join(text.strip() for text in texts if text.strip())


def usage(duration: float) -> dict:
    return {"type": "duration", "seconds": round(duration, 3)}


def render(
    response_format: str, text: str, segments: list[Segment], *, task: str, language: str,
    duration: float, words: list | None = None, list_segments: bool = True,
) -> tuple[bytes, str]:
    """(body, content type) for a finished transcription. verbose_json lists ``words``
    (``TimedWord``s) when given, and its segments unless ``list_segments`` is False (as
    OpenAI's API answers timestamp_granularities[]=word alone)."""
    if response_format == "json":
        return orjson.dumps({"text": text, "usage": usage(duration)}), "application/json"
    if response_format == "text":
        return (text + "\n").encode(), "text/plain; charset=utf-8"
    if response_format == "srt":
        return srt(segments).encode(), "text/plain; charset=utf-8"
    if response_format == "vtt":
        return vtt(segments).encode(), "text/vtt; charset=utf-8"
    body = {
        "task": task,
        "language": language,
        "duration": round(duration, 3),
        "text": text,
    }
    if words is not None:
        body["words"] = [{"word": word.word, "start": word.start, "end": word.end} for word in words]
    if list_segments:
        body["segments"] = [segment.body(index) for index, segment in enumerate(segments)]
    body["usage"] = usage(duration)
    return orjson.dumps(body), "application/json"


def _clock(seconds: float, separator: str) -> str:
    millis = int(round(max(seconds, 0.0) * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt(segments: list[Segment]) -> str:
    blocks = [
        f"{index}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for index, s in enumerate(segments, start=1)
    ]
    return "\n".join(blocks) + ("\n" if blocks else "")


def vtt(segments: list[Segment]) -> str:
    blocks = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in segments]
    return "WEBVTT\n\n" + "\n".join(blocks)
