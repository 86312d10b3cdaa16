"""Media fetching and decoding: policy enforcement, limits and error messages.

Network traffic stays on 127.0.0.1. Private addresses other than loopback appear only in
classifier checks and in fake DNS answers that the policy must refuse before connecting.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest
from PIL import Image, ImageFile

from conftest import png_header_only
from vlmd.errors import MediaError
from vlmd.media import fetch
from vlmd.media.fetch import fetch_bytes
from vlmd.media.image import decode_image, load_image
from vlmd.media.policy import MediaPolicy, host_matches_domains, is_disallowed_address

LOCAL = MediaPolicy(allowed_local_media_path=None, allow_private_urls=True)


def _encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


PNG = _encode(Image.new("RGB", (4, 3), (10, 20, 30)))


# --- a local HTTP server -----------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path, _, query = self.path.partition("?")
        try:
            if path == "/img":
                self._send(200, PNG)
            elif path.startswith("/redirect/"):  # /redirect/N: N redirects, then /img
                n = int(path.rsplit("/", 1)[1])
                self._send(302, headers={"Location": "/img" if n <= 1 else f"/redirect/{n - 1}"})
            elif path == "/to":
                self._send(302, headers={"Location": unquote(query)})
            elif path == "/host":
                self._send(200, self.headers["Host"].encode())
            elif path == "/big":  # no Content-Length: only the streaming count can stop it
                self.send_response(200)
                self.end_headers()
                for _ in range(160):
                    self.wfile.write(b"x" * 65536)
            elif path == "/big-cl":
                self.send_response(200)
                self.send_header("Content-Length", str(10**9))
                self.end_headers()
                self.wfile.write(b"x" * 1000)
            elif path == "/chunked":
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i in range(0, len(PNG), 7):
                    part = PNG[i:i + 7]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
            elif path == "/slow":
                time.sleep(3)
                self._send(200, PNG)
            elif path == "/trickle":  # each byte arrives well within timeout_s
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            else:
                self._send(404, b"not found")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on purpose


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # do not wait for /slow handlers at shutdown


@pytest.fixture(scope="module")
def server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """HTTPS on 127.0.0.1 with a self-signed certificate for public.test; yields (port, CA)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=public.test",
                    "-addext", "subjectAltName=DNS:public.test"], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], cert
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def fake_dns(monkeypatch):
    """Resolve *.test names to chosen addresses and treat 127.0.0.1 as public, so policy
    decisions on later hops can be observed without sending traffic anywhere but loopback."""
    real_resolve, real_classify = socket.getaddrinfo, fetch.is_disallowed_address
    answers = {"public.test": ["127.0.0.1"], "private.test": ["10.0.0.1"],
               "mixed.test": ["127.0.0.1", "10.0.0.1"]}
    calls = []

    def resolve(host, port, *args, **kwargs):
        calls.append(host)
        if host in answers:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answers[host]]
        return real_resolve(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(fetch, "is_disallowed_address",
                        lambda ip: ip != "127.0.0.1" and real_classify(ip))
    return answers, calls


def _raises(match: str, fn, *args):
    with pytest.raises(MediaError, match=match) as info:
        fn(*args)
    return info.value


# --- address classification and domain matching ------------------------------------------


@pytest.mark.parametrize("address", [
    "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1", "127.0.0.1", "127.9.9.9",
    "169.254.169.254", "0.0.0.0", "100.64.0.1", "224.0.0.1", "255.255.255.255", "::1", "::",
    "fe80::1", "fe80::1%eth0", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "::ffff:169.254.169.254", "64:ff9b::7f00:1", "2002:7f00:1::", "not-an-address",
])
def test_disallowed_addresses(address):
    assert is_disallowed_address(address)


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808",
])
def test_public_addresses(address):
    assert not is_disallowed_address(address)


def test_domain_matching():
    domains = MediaPolicy(allowed_domains=("Example.COM.", "*.cdn.org")).allowed_domains
    assert domains == ("example.com", "cdn.org")
    for host in ("example.com", "img.example.com", "EXAMPLE.com.", "a.b.cdn.org"):
        assert host_matches_domains(host, domains)
    for host in ("badexample.com", "example.com.evil.net", "org"):
        assert not host_matches_domains(host, domains)
    assert not host_matches_domains("127.0.0.1", ("0.0.1",))
    with pytest.raises(ValueError):
        MediaPolicy(allowed_domains="example.com")


# --- data: and schemes -------------------------------------------------------------------


def test_data_url():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert fetch_bytes(url, MediaPolicy()) == PNG
    assert load_image(url, MediaPolicy()).size == (4, 3)


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,!!!notbase64", "invalid base64 in data URL"),
    ("data:image/png;base64,abc", "invalid base64 in data URL"),  # bad padding
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:image/png;base64", "invalid data URL"),
])
def test_bad_data_urls(url, match):
    _raises(match, fetch_bytes, url, MediaPolicy())


def test_data_url_size_cap():
    url = "data:image/png;base64," + base64.b64encode(b"x" * 101).decode()
    _raises("larger than the media size limit of 100 bytes", fetch_bytes, url,
            MediaPolicy(max_bytes=100))
    assert fetch_bytes(url, MediaPolicy(max_bytes=101)) == b"x" * 101


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "javascript:alert(1)",
                                 "/etc/passwd", "iVBORw0KGgo" * 50, ""])
def test_unsupported_urls(url):
    _raises("unsupported media URL|non-empty", fetch_bytes, url, MediaPolicy())


# --- http(s):// --------------------------------------------------------------------------


def test_loopback_refused_by_default(server):
    for host in ("127.0.0.1", "localhost"):
        _raises("private, loopback", fetch_bytes, f"http://{host}:{server}/img", MediaPolicy())


def test_http_fetch_when_private_allowed(server):
    assert fetch_bytes(f"http://127.0.0.1:{server}/img", LOCAL) == PNG
    assert fetch_bytes(f"http://127.0.0.1:{server}/chunked", LOCAL) == PNG
    assert fetch_bytes(f"http://127.0.0.1:{server}/redirect/3", LOCAL) == PNG


def test_http_errors(server):
    base = f"http://127.0.0.1:{server}"
    _raises("HTTP 404", fetch_bytes, f"{base}/missing", LOCAL)
    _raises(r"too many redirects \(more than 3\)", fetch_bytes, f"{base}/redirect/4", LOCAL)
    _raises("redirect to a file URL", fetch_bytes, f"{base}/to?file:///etc/passwd", LOCAL)
    _raises("credentials", fetch_bytes, f"http://u:p@127.0.0.1:{server}/img", LOCAL)
    _raises("TLS error", fetch_bytes, f"https://127.0.0.1:{server}/img", LOCAL)


def test_size_cap_while_streaming(server):
    small = MediaPolicy(allow_private_urls=True, max_bytes=100_000)
    start = time.monotonic()
    for path in ("/big", "/big-cl"):
        _raises("larger than the media size limit", fetch_bytes,
                f"http://127.0.0.1:{server}{path}", small)
    assert time.monotonic() - start < 5


def test_timeouts(server):
    per_read = MediaPolicy(allow_private_urls=True, timeout_s=0.3)
    start = time.monotonic()
    _raises("timed out", fetch_bytes, f"http://127.0.0.1:{server}/slow", per_read)
    assert time.monotonic() - start < 2
    overall = MediaPolicy(allow_private_urls=True, timeout_s=1.0, total_timeout_s=0.5)
    start = time.monotonic()
    _raises("timed out", fetch_bytes, f"http://127.0.0.1:{server}/trickle", overall)
    assert time.monotonic() - start < 2


def test_connects_to_vetted_address_with_host_header(server, fake_dns):
    _, calls = fake_dns
    assert fetch_bytes(f"http://public.test:{server}/host", MediaPolicy()) == \
        f"public.test:{server}".encode()
    assert calls == ["public.test"]  # resolved once: no second lookup to rebind


def test_every_hop_is_rechecked(server, fake_dns):
    hop = f"http://public.test:{server}/to?"
    _raises("redirect target 'private.test'.*private", fetch_bytes,
            hop + f"http://private.test:{server}/img", MediaPolicy())
    _raises("not in the allowed media domains", fetch_bytes,
            hop + f"http://127.0.0.1:{server}/img", MediaPolicy(allowed_domains=("public.test",)))
    _raises("host 'mixed.test'.*private", fetch_bytes, f"http://mixed.test:{server}/img",
            MediaPolicy())


def test_https_verifies_certificate_against_host_name(tls_server, fake_dns, monkeypatch):
    port, ca = tls_server
    url = f"https://public.test:{port}/img"
    _raises("TLS certificate verification failed for 'public.test'", fetch_bytes, url,
            MediaPolicy())  # self-signed: not trusted by the system store
    trusting = ssl.create_default_context(cafile=ca)
    monkeypatch.setattr(fetch, "_tls_context", lambda: trusting)
    assert fetch_bytes(url, MediaPolicy()) == PNG  # SNI and Host name public.test, IP pinned
    _raises("TLS certificate verification failed for '127.0.0.1'", fetch_bytes,
            f"https://127.0.0.1:{port}/img", LOCAL)  # certificate names public.test only


# --- file:// -----------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a b.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    os.symlink(outside / "secret.png", allowed / "link.png")
    return allowed, outside, MediaPolicy(allowed_local_media_path=str(allowed))


def test_file_inside_allowed_dir(dirs):
    allowed, _, policy = dirs
    assert fetch_bytes(f"file://{allowed}/a%20b.png", policy) == PNG
    assert fetch_bytes(f"file://localhost{allowed}/a%20b.png", policy) == PNG


def test_file_refusals(dirs):
    allowed, outside, policy = dirs
    _raises("start the server with --allowed-local-media-path", fetch_bytes,
            f"file://{allowed}/a%20b.png", MediaPolicy())
    for url in (f"file://{outside}/secret.png", f"file://{allowed}/../outside/secret.png",
                f"file://{allowed}/link.png", "file:///etc/passwd"):
        _raises("outside --allowed-local-media-path", fetch_bytes, url, policy)
    _raises("file not found", fetch_bytes, f"file://{allowed}/nope.png", policy)
    _raises("not a regular file", fetch_bytes, f"file://{allowed}", policy)
    _raises("local path", fetch_bytes, f"file://otherhost{allowed}/a%20b.png", policy)
    small = MediaPolicy(allowed_local_media_path=str(allowed), max_bytes=10)
    _raises("larger than the media size limit", fetch_bytes, f"file://{allowed}/a%20b.png", small)


# --- decoding ----------------------------------------------------------------------------


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"definitely not an image", "cannot identify image"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "cannot identify image"),
    (_encode(Image.new("RGB", (1, 1))), r"too small: 1x1; the minimum is 2x2"),
    (_encode(Image.new("RGB", (1, 50))), r"too small: 1x50"),
])
def test_undecodable_images(data, match):
    _raises(match, decode_image, data, MediaPolicy())


def test_truncated_images():
    noise = Image.frombytes("RGB", (128, 128), os.urandom(128 * 128 * 3))
    for fmt in ("JPEG", "PNG"):
        data = _encode(noise, fmt)
        _raises(f"cannot decode {fmt} image", decode_image, data[: len(data) // 2], MediaPolicy())


@pytest.mark.parametrize("side", [20000, 7000])  # beyond PIL's own limit, and only ours
def test_bomb_header_refused_before_decoding(side, monkeypatch):
    def no_decoding(self):
        raise RuntimeError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    start = time.monotonic()
    _raises("image is too large", decode_image, png_header_only(side, side), MediaPolicy())
    assert time.monotonic() - start < 1


def test_policy_pixel_limit():
    data = _encode(Image.new("RGB", (20, 20)))
    _raises(r"too large \(20x20\): the limit is 399", decode_image, data,
            MediaPolicy(max_image_pixels=399))
    assert decode_image(data, MediaPolicy(max_image_pixels=400)).size == (20, 20)


def test_modes_convert_to_rgb():
    palette = Image.new("P", (3, 2), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    rgba = Image.new("RGBA", (2, 2), (255, 0, 0, 0))
    cases = [
        (_encode(palette), (200, 100, 50)),
        # Transparent pixels are composited onto white, as transformers' convert_rgb does.
        (_encode(rgba), (255, 255, 255)),
        (_encode(Image.new("RGBA", (2, 2), (255, 0, 0, 255))), (255, 0, 0)),
        (_encode(Image.new("L", (2, 2), 77)), (77, 77, 77)),
        (_encode(Image.new("LA", (2, 2), (77, 0))), (255, 255, 255)),
        (_encode(Image.new("LA", (2, 2), (77, 255))), (77, 77, 77)),
        (_encode(Image.new("CMYK", (8, 8), (0, 0, 0, 0)), "JPEG"), (255, 255, 255)),
        (_encode(Image.new("RGB", (2, 2), (1, 2, 3)), "GIF"), None),
        (_encode(Image.new("RGB", (2, 2), (1, 2, 3)), "WEBP", lossless=True), (1, 2, 3)),
    ]
    for data, pixel in cases:
        img = decode_image(data, MediaPolicy())
        assert img.mode == "RGB"
        if pixel is not None:
            assert img.getpixel((0, 0)) == pixel


def test_a_long_data_url_is_decoded_a_piece_at_a_time_to_the_same_bytes_and_refusals():
    """D110: base64 is decoded in pieces (binascii holds the GIL while it decodes); the bytes
    and the refusals are those of one validating decode."""
    import base64
    import binascii
    import os

    from vlmd.media.fetch import _BASE64_PIECE, _b64decode

    for size in (0, 5, 3 * _BASE64_PIECE // 4, 3 * _BASE64_PIECE // 4 + 1, 3 * _BASE64_PIECE + 2):
        data = os.urandom(size)
        assert _b64decode(base64.b64encode(data).decode()) == data
    piece = _BASE64_PIECE
    for bad in ("A" * (piece - 2) + "==" + "AAAA", "A" * (piece + 1), "A" * piece + "AA=A", "A" * (piece + 4) + "!AAA"):
        with pytest.raises(binascii.Error):
            base64.b64decode(bad, validate=True)
        with pytest.raises(binascii.Error):
            _b64decode(bad)
