"""What the server is willing to fetch and decode on a client's behalf.

A request can name any URL, so fetching is a server-side request forgery risk and decoding is
a memory-exhaustion risk; every limit lives here so one object, built once from the command
line, is passed to every fetch and decode.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# NAT64 embeds an IPv4 address in its last 32 bits; judge that address instead.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class MediaPolicy:
    # Directory that file:// URLs may read from; None refuses every file:// URL.
    allowed_local_media_path: str | None = None
    # Off by default so a client cannot make the server reach its own network (SSRF).
    allow_private_urls: bool = False
    # Hostnames (and their subdomains) that http(s) URLs may name; None allows any public host.
    allowed_domains: tuple[str, ...] | None = None
    # Cap on the bytes of one fetched item (data:, http(s) body or file).
    max_bytes: int = 20 * 2**20
    # Limit on connecting and on each read, so a silent server cannot hold a worker thread.
    timeout_s: float = 10.0
    # Limit on a whole fetch, redirects included, so a trickling server cannot either.
    total_timeout_s: float = 30.0
    max_redirects: int = 3
    # Checked against the image header before any pixel is decoded (decompression bombs).
    max_image_pixels: int = 40_000_000
    # Image processors downstream break on 1-pixel sides.
    min_image_side: int = 2
    # Longest side over shortest. Processors scale the short side up to a fixed size, so a
    # tiny 2x100000 image would be resized to gigapixels: a bomb that max_image_pixels cannot
    # see. 200 matches the bound Qwen2-VL's processor enforces.
    max_image_aspect_ratio: float = 200.0
    # Audio uploads (/v1/audio/*): the file as sent, then the decoded signal. OpenAI's own
    # upload limit is 25 MB; 600 s of decoded audio is 20 Whisper windows.
    max_audio_bytes: int = 25 * 2**20
    max_audio_duration_s: float = 600.0
    # float32 samples at the source rate and channel count, before mixing and resampling:
    # 600 s of 48 kHz stereo fits, 8 channels at 192 kHz for the same time does not.
    max_audio_decoded_bytes: int = 256 * 2**20
    # Video (frames are also held to the image limits above). Frames sampled uniformly from a
    # video; --media-io-kwargs '{"video": {"num_frames": N}}' sets it.
    video_num_frames: int = 32
    # Or sample this many frames per second of video (at most video_num_frames): '{"video":
    # {"fps": F}}'. None: video_num_frames whatever the length.
    video_fps: float | None = None
    # A video is fetched whole before decoding, so it has its own, larger byte cap.
    max_video_bytes: int = 64 * 2**20
    # Decoding walks the stream up to the last sampled frame: frames and duration bound the CPU
    # time one request can cost.
    max_video_frames: int = 18_000
    max_video_duration_s: float = 600.0
    # Memory of the kept RGB frames (frames x width x height x 3), checked before decoding.
    max_video_decoded_bytes: int = 2**30

    def __post_init__(self) -> None:
        # Bad settings are an operator mistake found at startup, hence ValueError, not a 400.
        # Frozen dataclass: normalise through object.__setattr__.
        if self.allowed_domains is not None:
            if isinstance(self.allowed_domains, str):
                raise ValueError("allowed_domains must be a sequence of hostnames, not a string")
            domains = tuple(_normalise_domain(d) for d in self.allowed_domains)
            object.__setattr__(self, "allowed_domains", domains)
        if self.allowed_local_media_path == "":
            object.__setattr__(self, "allowed_local_media_path", None)
        for name in (
            "max_bytes", "max_image_pixels", "min_image_side", "video_num_frames", "max_video_bytes",
            "max_video_frames", "max_video_decoded_bytes", "max_audio_bytes", "max_audio_decoded_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"media policy {name} must be at least 1")
        if self.video_fps is not None and not self.video_fps > 0:
            raise ValueError("media policy video_fps must be positive")
        if not self.max_image_aspect_ratio >= 1:
            raise ValueError("media policy max_image_aspect_ratio must be at least 1")
        if not self.max_audio_duration_s > 0:
            raise ValueError("media policy max_audio_duration_s must be positive")
        if self.max_redirects < 0:
            raise ValueError("media policy max_redirects must not be negative")
        if self.timeout_s <= 0 or self.total_timeout_s <= 0:
            raise ValueError("media policy timeouts must be positive")
        if not self.max_video_duration_s > 0:
            raise ValueError("media policy max_video_duration_s must be positive")


def _normalise_domain(domain: str) -> str:
    # Compare hostnames in the form the fetcher sees them: lower-case ASCII, no trailing dot.
    d = domain.strip().rstrip(".").lower()
    if d.startswith("*."):
        d = d[2:]  # "*.example.com" means what "example.com" already means: it and subdomains
    if not d:
        raise ValueError(f"invalid allowed domain {domain!r}")
    try:
        return d.encode("idna").decode("ascii")
    except UnicodeError as exc:
        raise ValueError(f"invalid allowed domain {domain!r}") from exc


def is_disallowed_address(address: str) -> bool:
    """True for any address that is not on the public internet (the SSRF guard)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return True  # fail closed on anything unparseable
    if isinstance(ip, ipaddress.IPv6Address):
        # Addresses that carry an IPv4 address reach that address: judge it, not the wrapper.
        if ip.ipv4_mapped is not None:
            return is_disallowed_address(str(ip.ipv4_mapped))
        if ip in _NAT64:
            return is_disallowed_address(str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
        if ip.sixtofour is not None and is_disallowed_address(str(ip.sixtofour)):
            return True
        if ip.teredo is not None and any(is_disallowed_address(str(a)) for a in ip.teredo):
            return True
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or not ip.is_global  # also catches shared (100.64/10) and documentation ranges
    )


def host_matches_domains(host: str, domains: tuple[str, ...]) -> bool:
    """True if ``host`` is one of ``domains`` or a subdomain of one (IP literals: exact only)."""
    host = host.rstrip(".").lower()
    if _is_ip_literal(host):
        return host in domains  # "0.0.1" must not match "127.0.0.1" as a "subdomain"
    return any(host == d or host.endswith("." + d) for d in domains)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
