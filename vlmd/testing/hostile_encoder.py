"""A hostile encoder server on 127.0.0.1, for tests and soaks (``--encoder-urls``).

It reads each request whole, then answers as its next mode says (a queue the test fills,
or a cycle it was given): an answer whose tensor has the wrong width or rows, is NaN or
infinite, or names another model; a silence; a body or headers dripped a few bytes a
second; or, with ``upstream`` (a real ``--encoder-only`` server), that server's answer
corrupted (one more column, a row less, one NaN) or passed through. A language server
must treat every one of these as a failed server: fall back to its own encoder, within
``--encoder-timeout-s``. No drip or silence lasts longer than ``HANG_S``.
"""

from __future__ import annotations

import collections
import itertools
import socketserver
import threading
import urllib.request

import numpy as np

from vlmd.encoder_wire import MEDIA_TYPE, WireTensor, pack, unpack

HANG_S = 60.0  # the longest a silence or a drip holds a connection
IDENTIFIER = "ab" * 32  # the item the made-up answers are for
TOKENS, WIDTH = 4, 8  # the made-up answers' shape


def made_up_answer(model: str, rows: int = TOKENS, width: int = WIDTH, fill: float = 0.5) -> bytes:
    values = np.full((rows, width), fill, dtype=np.float32)
    return pack({IDENTIFIER: WireTensor("image", "F32", (rows, width), values.tobytes())}, model)


def response_head(length: int) -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {MEDIA_TYPE}\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode()


def read_request(sock) -> bytes:
    """One HTTP request's body (headers up to the blank line, then Content-Length bytes)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return b""
        received += chunk
    head, body = received.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return body


def corrupted(answer: bytes, mode: str) -> bytes:
    """A real encoder server's answer, made hostile: one more column, a row less, one NaN."""
    if mode == "proxy-good":
        return answer
    model, tensors = unpack(answer)
    changed = {}
    for identifier, tensor in tensors.items():
        if tensor.dtype != "F32":
            raise ValueError(f"the upstream answers {tensor.dtype}; the proxy corrupts F32 outputs only")
        values = np.frombuffer(bytes(tensor.data), dtype=np.float32).reshape(tensor.shape)
        if mode == "proxy-wide":
            values = np.concatenate([values, values[:, :1]], axis=1)
        elif mode == "proxy-rows":
            values = values[:-1]
        elif mode == "proxy-nan":
            values = values.copy()
            values.flat[min(7, values.size - 1)] = np.nan
        else:
            raise ValueError(f"unknown proxy mode {mode}")
        values = np.ascontiguousarray(values, dtype=np.float32)
        changed[identifier] = WireTensor(tensor.modality, "F32", values.shape, values.tobytes())
    return pack(changed, model)


class HostileEncoder:
    """The server; ``url`` is where it listens. ``modes`` (a deque) is consumed first, then
    ``cycle`` (if given) repeats, else every answer is "good" (a made-up, well-formed one)."""

    def __init__(self, model: str = "tiny", upstream: str | None = None, cycle: tuple[str, ...] = ()):
        self.model = model
        self.upstream = upstream
        self.modes: collections.deque[str] = collections.deque()
        self._cycle = itertools.cycle(cycle) if cycle else None
        self._lock = threading.Lock()
        self.release = threading.Event()
        self.answered: collections.Counter[str] = collections.Counter()
        hostile = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                request = read_request(self.request)
                mode = hostile.next_mode()
                hostile.answered[mode] += 1
                try:
                    hostile.answer(self.request, request, mode)
                except OSError:  # the client gave up: what its deadline is for
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_mode(self) -> str:
        with self._lock:
            if self.modes:
                return self.modes.popleft()
            return next(self._cycle) if self._cycle is not None else "good"

    def answer(self, sock, request: bytes, mode: str) -> None:
        if mode == "hang":
            self.release.wait(HANG_S)
        elif mode == "drip-body":  # headers at once, then two bytes a second
            body = made_up_answer(self.model)
            sock.sendall(response_head(len(body)))
            self._drip(sock, body, 2, 1.0)
        elif mode == "drip-headers":  # a byte every half second
            self._drip(sock, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000, 1, 0.5)
        elif mode.startswith("proxy-"):
            upstream = urllib.request.Request(self.upstream + "/v1/encoder_outputs", data=request, method="POST",
                                              headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(upstream, timeout=60) as response:
                body = corrupted(response.read(), mode)
            sock.sendall(response_head(len(body)) + body)
        else:
            body = {"good": lambda: made_up_answer(self.model),
                    "wide": lambda: made_up_answer(self.model, width=WIDTH + 1),
                    "narrow": lambda: made_up_answer(self.model, width=WIDTH - 1),
                    "rows": lambda: made_up_answer(self.model, rows=TOKENS + 1),
                    "nan": lambda: made_up_answer(self.model, fill=float("nan")),
                    "inf": lambda: made_up_answer(self.model, fill=float("inf")),
                    "model": lambda: made_up_answer("other")}[mode]()
            sock.sendall(response_head(len(body)) + body)

    def _drip(self, sock, data: bytes, size: int, every_s: float) -> None:
        """``size`` bytes of ``data`` every ``every_s`` seconds, for at most ``HANG_S`` in all."""
        for start in range(0, min(len(data), int(HANG_S / every_s) * size), size):
            if self.release.wait(every_s):
                return
            sock.sendall(data[start:start + size])

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
