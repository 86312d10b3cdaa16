"""Word times from a cross-attention alignment: dynamic time warping, then words of tokens.

The model (``alignment.py``, on the engine thread) gives one matrix per window: for every
output token fed to the decoder, the normalised, median-filtered cross-attention of the
checkpoint's alignment heads over the window's 20 ms encoder frames. Here, on the
preprocessing pool, the cheapest monotonic path through its negation (DTW) maps each token
to the frame where its row first appears on the path: that is the time the token *ends*
(the row of a fed token is where the decoder looks while predicting the next one), and
the previous token's time is where it starts, as transformers' ASR pipeline reads
``generate(..., return_token_timestamps=True)``. Tokens then group into words by
transformers' and openai-whisper's rules: split where a piece starts with a space or is
punctuation (or, for languages written without spaces, at every whole character), then
leading punctuation joins the next word and trailing punctuation the previous one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FRAME_SECONDS = 0.02  # one encoder frame (30 s / 1,500)
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
PREPEND_PUNCTUATION = "\"'“¡¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
# Languages written without spaces between words: split at whole characters instead.
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Word:
    text: str  # as decoded, with its leading space
    start: float  # seconds from the window start
    end: float


def dtw_path(cost_matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) indices of the cheapest monotonic path from (0, 0) to the last cell.

    The recurrence is computed one anti-diagonal at a time (each cell needs only the two
    diagonals before it), so a window costs ~rows + columns numpy operations rather than
    rows x columns Python steps. Ties break as openai-whisper's and transformers' loops do
    (diagonal only when strictly cheapest, then up, else left), and the running cost is
    kept in float32 as theirs is, so the path is the same.
    """
    rows, cols = cost_matrix.shape
    values = np.asarray(cost_matrix, dtype=np.float64)
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    cost[0, 0] = 0.0
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    for diagonal in range(2, rows + cols + 1):
        i = np.arange(max(1, diagonal - cols), min(rows, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2)).astype(np.int8)
        best = np.choose(step, (c0, c1, c2))
        cost[i, j] = (values[i - 1, j - 1] + best.astype(np.float64)).astype(np.float32)
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = rows, cols
    path_rows, path_cols = [], []
    while i > 0 or j > 0:
        path_rows.append(i - 1)
        path_cols.append(j - 1)
        step = trace[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        elif step == 2:
            j -= 1
        else:
            raise RuntimeError("no monotonic path through the alignment (a bug in the DTW)")
    return np.array(path_rows[::-1]), np.array(path_cols[::-1])


def token_end_times(alignment: np.ndarray) -> list[float]:
    """Per row of ``alignment`` ([tokens, frames], larger = more attended): the time in
    seconds of the first frame the DTW path reaches that row at."""
    if alignment.shape[0] == 0 or alignment.shape[1] == 0:
        return [0.0] * alignment.shape[0]
    path_rows, path_cols = dtw_path(-alignment.astype(np.float64))
    jumps = np.concatenate(([True], np.diff(path_rows) != 0))
    return [round(float(frame) * FRAME_SECONDS, 2) for frame in path_cols[jumps]]


def split_words(token_ids: list[int], end_times: list[float], is_text: Callable[[int], bool],
                is_timestamp: Callable[[int], bool], decode: Callable[[list[int]], str],
                unspaced: bool = False) -> list[Word]:
    """The words of one window's output. Words never span a segment: text runs from one
    closing timestamp to the next (a timestamp equal to the opening one does not close, as
    transformers reads it); other control tokens (a language token the model emitted) are
    left out of the words. A token spans from the previous token's time (0 for the first)
    to its own."""
    words: list[Word] = []
    run: list[int] = []  # positions of the current segment's text tokens
    opening: int | None = None
    for index, token in enumerate(token_ids):
        if is_timestamp(token):
            if opening is None:
                opening = token
            elif token != opening:
                words += _timed_words(run, token_ids, end_times, decode, unspaced)
                run, opening = [], None
        elif is_text(token):
            run.append(index)
    return words + _timed_words(run, token_ids, end_times, decode, unspaced)


def _timed_words(run: list[int], token_ids: list[int], end_times: list[float], decode, unspaced: bool) -> list[Word]:
    words = []
    for text, positions in _combine_into_words([token_ids[k] for k in run], decode, unspaced):
        first, last = run[positions[0]], run[positions[-1]]
        words.append(Word(text, end_times[first - 1] if first > 0 else 0.0, end_times[last]))
    return words


def _combine_into_words(tokens: list[int], decode, unspaced: bool) -> list[tuple[str, list[int]]]:
    pieces = _split_on_characters(tokens, decode)
    if not unspaced:
        pieces = _split_on_spaces(pieces)
    return _merge_punctuation(pieces)


def _split_on_characters(tokens: list[int], decode) -> list[tuple[str, list[int]]]:
    """Runs of tokens that each decode to whole characters (a multi-byte character may take
    several byte tokens; a replacement character the full text itself has is kept)."""
    full = decode(tokens)
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    offset = 0
    for position, token in enumerate(tokens):
        current.append(position)
        text = decode([tokens[k] for k in current])
        bad = text.find(REPLACEMENT)
        if bad < 0 or offset + bad >= len(full) or full[offset + bad] == REPLACEMENT:
            pieces.append((text, current))
            current = []
            offset += len(text)
    return pieces


def _split_on_spaces(pieces: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    words: list[tuple[str, list[int]]] = []
    for text, positions in pieces:
        # ``in`` on the string, as the reference does: whitespace-only pieces split too.
        if not words or text.startswith(" ") or text.strip() in PUNCTUATION:
            words.append((text, list(positions)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + positions)
    return words


def _merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    texts = [text for text, _ in words]
    positions = [list(p) for _, p in words]
    i, j = len(texts) - 2, len(texts) - 1
    while i >= 0:  # opening punctuation joins the word after it
        if texts[i].startswith(" ") and texts[i].strip() in PREPEND_PUNCTUATION:
            texts[j], positions[j] = texts[i] + texts[j], positions[i] + positions[j]
            texts[i], positions[i] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(texts):  # closing punctuation joins the word before it
        if not texts[i].endswith(" ") and texts[j] in APPEND_PUNCTUATION:
            texts[i], positions[i] = texts[i] + texts[j], positions[i] + positions[j]
            texts[j], positions[j] = "", []
        else:
            i = j
        j += 1
    return [(text, p) for text, p in zip(texts, positions) if text and p]
