"""Fetch the bytes a media URL names: data:, http(s):// or file://, under a MediaPolicy.

Blocking on purpose: callers run it on a thread pool, never on the event loop. Every failure
is a MediaError whose message is safe to show the client (no tracebacks, no resolved IPs).
"""

from __future__ import annotations

import base64
import binascii
import functools
import http.client
import os
import socket
import ssl
import stat
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urljoin, urlsplit

from vlmd.errors import MediaError
from vlmd.media.policy import MediaPolicy, host_matches_domains, is_disallowed_address

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK = 64 * 1024
# identity: a compressed body would dodge the size cap and the image decoder cannot read it.
_REQUEST_HEADERS = {"User-Agent": "vlmd", "Accept": "*/*", "Accept-Encoding": "identity"}
# Characters left as they are when re-quoting a request path (existing %-escapes survive).
_PATH_SAFE = "/?&=%:@!$'()*+,;[]~"


def fetch_bytes(url: str, policy: MediaPolicy) -> bytes:
    """Return the bytes ``url`` names, or raise MediaError."""
    if not isinstance(url, str) or not url.strip():
        raise MediaError("media URL must be a non-empty string")
    url = url.strip()
    head, colon, _ = url[:16].partition(":")  # not the whole string: data URLs are huge
    scheme = head.lower() if colon else ""
    if scheme == "data":
        return _fetch_data(url, policy)
    if scheme == "file":
        return _fetch_file(url, policy)
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    raise MediaError(f"unsupported media URL {_describe(url)}: use http, https, data or file")


# --- data: -------------------------------------------------------------------------------


def _fetch_data(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError("invalid data URL: expected data:<media type>;base64,<data>")
    if not header.lower().endswith(";base64"):
        raise MediaError("data URLs must be base64-encoded: data:<media type>;base64,<data>")
    # Refuse before decoding: 4 base64 characters carry 3 bytes.
    if len(payload) > 4 * ((policy.max_bytes + 2) // 3):
        raise _too_large("data URL", policy)
    try:
        data = _b64decode(payload)
    except (binascii.Error, ValueError):
        raise MediaError("invalid base64 in data URL") from None
    if len(data) > policy.max_bytes:
        raise _too_large("data URL", policy)
    return data


# Characters of base64 decoded at once (a multiple of 4). binascii holds the GIL while it
# decodes, ~5 ms a MB on this host: a 2048x1536 JPEG's 3 MB in one call kept the event loop
# and every other thread waiting 15 ms (D110); a piece at a time, each waits ~1 ms at most.
_BASE64_PIECE = 2**18


def _b64decode(payload: str) -> bytes:
    """``base64.b64decode(payload, validate=True)``, a piece at a time: the same bytes and the
    same refusals (padding only at the very end)."""
    if len(payload) <= _BASE64_PIECE:
        return base64.b64decode(payload, validate=True)
    pieces = []
    for start in range(0, len(payload), _BASE64_PIECE):
        piece = payload[start:start + _BASE64_PIECE]
        if start + _BASE64_PIECE < len(payload) and piece.endswith("="):
            raise binascii.Error("padding before the end of the data")
        pieces.append(base64.b64decode(piece, validate=True))
    return b"".join(pieces)


# --- file:// -----------------------------------------------------------------------------


def _fetch_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaError(
            "file:// URLs are not allowed; start the server with --allowed-local-media-path"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must name a local path: file:///absolute/path")
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path:
        raise MediaError("invalid file:// URL: expected file:///absolute/path")
    # realpath resolves ".." and symlinks, so neither can lead out of the allowed directory.
    root = os.path.realpath(policy.allowed_local_media_path)
    real = os.path.realpath(path)
    try:
        inside = os.path.commonpath([root, real]) == root
    except ValueError:
        inside = False
    if not inside:
        raise MediaError(f"path {path!r} is outside --allowed-local-media-path")
    # O_NOFOLLOW: a symlink swapped in after realpath is refused; O_NONBLOCK: a FIFO cannot
    # hang the open.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise MediaError(f"file not found: {path!r}") from None
    except OSError as exc:
        raise MediaError(f"cannot read {path!r}: {exc.strerror or 'error'}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{path!r} is not a regular file")
        if st.st_size > policy.max_bytes:
            raise _too_large(f"file {path!r}", policy)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(policy.max_bytes + 1)  # the file may grow after fstat
    except OSError as exc:
        raise MediaError(f"cannot read {path!r}: {exc.strerror or 'error'}") from None
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:
        raise _too_large(f"file {path!r}", policy)
    return data


# --- http(s):// --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    tls: bool
    host: str  # ASCII (IDNA) host name or IP literal, no brackets
    port: int
    path: str  # request target: path and query, percent-encoded
    addrs: tuple[tuple[int, tuple], ...]  # vetted (family, sockaddr) to connect to


def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    deadline = time.monotonic() + policy.total_timeout_s
    for hop in range(policy.max_redirects + 1):
        target = _vet_http_url(url, policy, redirected=hop > 0)
        body, location = _get(target, url, policy, deadline)
        if location is None:
            return body
        url = urljoin(url, location)  # Location may be relative
    raise MediaError(f"too many redirects (more than {policy.max_redirects}) fetching media")


def _vet_http_url(url: str, policy: MediaPolicy, *, redirected: bool) -> _Target:
    """Apply the policy to one hop: scheme, domain list, and every address the host has."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaError(f"invalid media URL {_describe(url)}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        # Only reachable through a redirect: never let a server bounce us to file: or data:.
        raise MediaError(f"refusing to follow a redirect to a {scheme or 'relative'} URL")
    if parts.username is not None or parts.password is not None:
        raise MediaError("media URLs with credentials are not supported")
    host = parts.hostname
    if not host:
        raise MediaError(f"media URL {_describe(url)} has no host")
    try:
        host = host.rstrip(".").encode("idna").decode("ascii")
    except UnicodeError:
        raise MediaError(f"invalid host name in media URL {_describe(url)}") from None
    where = "redirect target" if redirected else "host"
    domains = policy.allowed_domains
    if domains is not None and not host_matches_domains(host, domains):
        raise MediaError(f"{where} {host!r} is not in the allowed media domains")
    tls = scheme == "https"
    port = port or (443 if tls else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise MediaError(f"cannot resolve host {host!r}") from None
    inet = (socket.AF_INET, socket.AF_INET6)
    addrs = tuple((fam, sa) for fam, _, _, _, sa in infos if fam in inet)
    if not addrs:
        raise MediaError(f"cannot resolve host {host!r}")
    # Every address must pass, not just the first: the connection may fall through to any.
    if not policy.allow_private_urls and any(is_disallowed_address(sa[0]) for _, sa in addrs):
        raise MediaError(
            f"refusing to fetch media from {where} {host!r}: it resolves to a private, "
            "loopback, link-local or reserved address"
        )
    path = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        path += "?" + quote(parts.query, safe=_PATH_SAFE)
    return _Target(tls=tls, host=host, port=port, path=path, addrs=addrs)


def _get(target: _Target, url: str, policy: MediaPolicy, deadline: float):
    """One GET: (body, None) on 2xx, (None, location) on a redirect; MediaError otherwise."""
    conn = None
    try:
        conn = _PinnedConnection(target, timeout=_step_timeout(policy, deadline))
        conn.request("GET", target.path, headers=_REQUEST_HEADERS)
        resp = conn.getresponse()
        if resp.status in _REDIRECT_STATUSES:
            location = resp.getheader("Location")
            if not location:
                raise MediaError(f"HTTP {resp.status} redirect without a Location header")
            return None, location
        if not 200 <= resp.status < 300:
            status = f"HTTP {resp.status} {resp.reason}".rstrip()
            raise MediaError(f"fetching {_describe(url)} failed: {status}")
        if resp.length is not None and resp.length > policy.max_bytes:
            raise _too_large(f"response from {_describe(url)}", policy)
        chunks, total = [], 0
        while True:
            conn.raw_sock.settimeout(_step_timeout(policy, deadline))
            chunk = resp.read1(_READ_CHUNK)  # one recv at most, so the deadline holds
            if not chunk:
                return b"".join(chunks), None
            total += len(chunk)
            if total > policy.max_bytes:  # stop reading: the rest may be endless
                raise _too_large(f"response from {_describe(url)}", policy)
            chunks.append(chunk)
    except MediaError:
        raise
    except TimeoutError:
        raise MediaError(f"timed out fetching {_describe(url)}") from None
    except ssl.SSLCertVerificationError:
        raise MediaError(f"TLS certificate verification failed for {target.host!r}") from None
    except ssl.SSLError:
        raise MediaError(f"TLS error fetching {_describe(url)}") from None
    except (http.client.HTTPException, ValueError):
        raise MediaError(f"invalid HTTP response fetching {_describe(url)}") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise MediaError(f"cannot fetch {_describe(url)}: {reason}") from None
    finally:
        if conn is not None:
            conn.close()


class _PinnedConnection(http.client.HTTPConnection):
    """Connects only to the vetted addresses, never re-resolving the host name: a second
    lookup could answer with a private address (DNS rebinding). Host header and TLS SNI and
    certificate checks still use the host name."""

    def __init__(self, target: _Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self.default_port = 443 if target.tls else 80  # Host header omits a default port
        self._target = target
        # http.client drops conn.sock once a response owns the socket; keep our own handle so
        # read timeouts can still be tightened toward the deadline.
        self.raw_sock: socket.socket | None = None

    def connect(self) -> None:
        error: OSError = OSError("no usable address")
        for family, sockaddr in self._target.addrs:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect(sockaddr)
                break
            except OSError as exc:
                sock.close()
                error = exc
        else:
            raise error
        if self._target.tls:
            try:
                sock = _tls_context().wrap_socket(sock, server_hostname=self._target.host)
            except BaseException:
                sock.close()
                raise
        self.sock = self.raw_sock = sock


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # verifies certificates and host names


def _step_timeout(policy: MediaPolicy, deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError
    return min(policy.timeout_s, remaining)


def _too_large(what: str, policy: MediaPolicy) -> MediaError:
    return MediaError(f"{what} is larger than the media size limit of {policy.max_bytes} bytes")


def _describe(url: str) -> str:
    # Echo enough of a URL to recognise it, never a whole multi-megabyte one.
    return repr(url if len(url) <= 120 else url[:120] + "...")
