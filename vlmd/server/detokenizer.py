"""Incremental detokenization and stop strings, on the event-loop side.

Text is released as tokens arrive, except for the last ``longest stop string - 1``
characters, which are held back until it is clear they do not begin a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = list(stop or [])
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._released = 0
        self.stopped = False  # a stop string matched: the caller should end the request

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new tokens; return the text that may be shown now."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece
        if self._stop:
            search_from = max(0, self._released - self._hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        end = len(self.text) if (final or self.stopped) else max(self._released, len(self.text) - self._hold)
        released, self._released = self.text[self._released : end], end
        return released
