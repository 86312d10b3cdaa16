"""A light request never waits behind a whole image decode, however large the images
(issue 47 item 2, D116), through a real server.

While image requests are in flight, each phase's images larger than the last (640x480 and
2048x1536 as data URLs, A4 pages at 200 dpi fetched over http from a loopback server,
4096x3072 as data URLs), text probes are sent one after another. Each probe's stage line
(``--log-request-stages``) carries ``pixels_waited``: at least the pixels of the image decodes
that began and ended while it waited for a preprocessing thread or for the event loop to take
its result back, or for the loop from its arrival and from its first token
(``media/image.py:DecodedPixels``). The criterion is a count, not a time: a probe's waits never
held one whole image of its phase (nor 2048x1536 pixels of small ones), so they stay shorter
than one decode as the images grow. Decoding on the event loop, or letting media work take the thread kept
for text, makes a probe wait behind whole decodes, and this test fails.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import orjson
import pytest
from PIL import Image, ImageDraw

from conftest import Server

IMAGES_PER_REQUEST = 3
# A probe's waits are bounded by one image of its phase, but never below 2048x1536 pixels:
# a 640x480 decode (a few ms) fits in one turn of the loop on a loaded 2-core host, where a
# probe's waits may hold a few of them whole without anything being wrong.
SMALLEST_COUNTED = 2048 * 1536
FLOOD_REQUESTS = 4  # a phase's image requests, two at a time
PHASES = [  # (width, height, how the images travel)
    (640, 480, "data"),
    (2048, 1536, "data"),
    (1654, 2339, "http"),  # A4 at 200 dpi
    (4096, 3072, "data"),
]


@pytest.fixture(scope="module")
def media_server():
    """A loopback http server of JPEG bytes by path."""
    images: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = images.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield images, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    # Two threads: one for media work, one kept for text (D110).
    server = Server(tiny_llava_dir, "--log-request-stages", "--preprocess-threads", "2",
                    "--allow-private-media-urls", "--preprocess-timeout", "120", "--no-warmup",
                    name="probe-images", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def jpeg(seed: int, width: int, height: int) -> bytes:
    """A page-like JPEG (word boxes on a gradient): distinct bytes for every seed, so no
    cache spares a decode, and cheap to make at any size."""
    rng = np.random.default_rng(seed)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(200):
        x, y = int(rng.integers(0, width - 60)), int(rng.integers(0, height - 20))
        draw.rectangle([x, y, x + int(rng.integers(10, 60)), y + 16], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=85)
    return buffer.getvalue()


def image_urls(media_server, phase: int, width: int, height: int, travel: str) -> list[str]:
    images, base = media_server
    urls = []
    for index in range(FLOOD_REQUESTS * IMAGES_PER_REQUEST):
        data = jpeg(1000 * phase + index, width, height)
        if travel == "http":
            path = f"/{phase}/{index}.jpg"
            images[path] = data
            urls.append(base + path)
        else:
            urls.append("data:image/jpeg;base64," + base64.b64encode(data).decode())
    return urls


def stage_lines(server: Server) -> dict[str, dict]:
    lines = {}
    for line in server.log_path.read_text().splitlines():
        if '"request stages"' in line:
            record = orjson.loads(line)
            lines[record["request_id"].rsplit("-", 1)[0]] = record
    return lines


def probe(server: Server) -> str:
    status, answer = server.chat({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                                  "temperature": 0})
    assert status == 200, answer
    return answer["id"]


@pytest.mark.parametrize("phase", range(len(PHASES)), ids=[f"{w}x{h}-{t}" for w, h, t in PHASES])
def test_a_probe_never_waits_behind_a_whole_image_decode(server, media_server, phase):
    width, height, travel = PHASES[phase]
    urls = image_urls(media_server, phase, width, height, travel)

    def image_request(index: int) -> tuple[int, dict]:
        parts = [{"type": "image_url", "image_url": {"url": url}}
                 for url in urls[index * IMAGES_PER_REQUEST:(index + 1) * IMAGES_PER_REQUEST]]
        return server.chat({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}],
                            "max_tokens": 2, "temperature": 0}, timeout=300)

    before = server.metrics()["vlmd_decoded_image_queries_total"]
    probes = []
    with ThreadPoolExecutor(2) as pool:
        flood = [pool.submit(image_request, index) for index in range(FLOOD_REQUESTS)]
        while server.metrics()["vlmd_decoded_image_queries_total"] == before:  # the first image is being read
            time.sleep(0.005)
        while not all(job.done() for job in flood):
            probes.append((probe(server), sum(not job.done() for job in flood)))
        for job in flood:
            status, answer = job.result()
            assert status == 200, answer

    in_flight = [probe_id for probe_id, pending in probes if pending]
    assert len(in_flight) >= 2, probes  # answered while image requests were still in flight
    lines = stage_lines(server)
    images = [line for line in lines.values() if line["input"] == "media"]
    assert images and all(line["decode_ms"] > 0 for line in images)
    bound = max(width * height, SMALLEST_COUNTED)
    waited = {probe_id: lines[probe_id]["pixels_waited"] for probe_id in in_flight}
    assert all(pixels < bound for pixels in waited.values()), (bound, waited)
