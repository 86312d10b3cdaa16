"""Server-wide settings, from the command line. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmd.errors import BadRequestError


@dataclass
class ServeConfig:
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_gb: float = 4.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests, capacity planning)
    seed: int = 0
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    allowed_local_media_path: str | None = None
    allow_private_media_urls: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    media_max_bytes: int = 20 * 2**20
    media_timeout_s: float = 10.0
    preprocess_threads: int = 4
    torch_threads: int | None = None
    disable_chunked_mm_input: bool = False
    enable_prefix_caching: bool = True
    mm_processor_cache_gb: float = 4.0
    max_num_encoder_input_tokens: int | None = None  # default: max_num_batched_tokens
    encoder_cache_size: int | None = None  # default: max_num_batched_tokens
    api_key: str | None = None
    # Server-wide processor settings (e.g. {"max_pixels": N}); a request's own
    # mm_processor_kwargs are merged over them.
    mm_processor_kwargs: dict = field(default_factory=dict)
    # Decode settings per modality, e.g. {"video": {"num_frames": 16}} (see MEDIA_IO_FIELDS).
    media_io_kwargs: dict = field(default_factory=dict)
    max_request_bytes: int = 64 * 2**20
    warmup: bool = True

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """``image=2,video=1`` (vLLM also takes JSON: ``{"image": 2}``)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        import json

        raw = json.loads(text)
        return {str(key): int(value) for key, value in raw.items()}
    limits: dict[str, int] = {}
    for part in text.split(","):
        modality, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"expected MODALITY=N in --limit-mm-per-prompt, got {part!r}")
        limits[modality.strip()] = int(value)
    return limits


# --media-io-kwargs '{"video": {...}}' keys -> MediaPolicy fields.
VIDEO_IO_FIELDS = {
    "num_frames": "video_num_frames",
    "max_frames": "max_video_frames",
    "max_duration_s": "max_video_duration_s",
    "max_bytes": "max_video_bytes",
    "max_decoded_bytes": "max_video_decoded_bytes",
}

# --media-io-kwargs '{"audio": {...}}' keys -> MediaPolicy fields (uploads to /v1/audio/*).
AUDIO_IO_FIELDS = {
    "max_bytes": "max_audio_bytes",
    "max_duration_s": "max_audio_duration_s",
    "max_decoded_bytes": "max_audio_decoded_bytes",
}
MEDIA_IO_FIELDS = {"video": VIDEO_IO_FIELDS, "audio": AUDIO_IO_FIELDS}


def parse_json_object(text: str, flag: str) -> dict:
    """A command-line JSON object such as --mm-processor-kwargs '{"max_pixels": 100352}'."""
    import json

    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def media_policy_fields(media_io_kwargs: dict) -> dict:
    """MediaPolicy keyword arguments from --media-io-kwargs; unknown keys are an error."""
    fields = {}
    for modality, settings in media_io_kwargs.items():
        known = MEDIA_IO_FIELDS.get(modality)
        if known is None or not isinstance(settings, dict):
            raise ValueError(
                '--media-io-kwargs takes {"video": {...}, "audio": {...}} (no other modality has settings)'
            )
        if not settings:  # most likely a typo'd or half-written flag: say so instead of ignoring it
            raise ValueError(f"--media-io-kwargs {modality} names no settings; known: {sorted(known)}")
        for key, value in settings.items():
            if key not in known:
                raise ValueError(f"--media-io-kwargs {modality}.{key} is unknown; known: {sorted(known)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"--media-io-kwargs {modality}.{key} must be a number")
            fields[known[key]] = value
    return fields


def check_mm_limits(counts: dict[str, int], limits: dict[str, int]) -> None:
    for modality, count in counts.items():
        limit = limits.get(modality)
        if limit is not None and count > limit:
            raise BadRequestError(
                f"at most {limit} {modality}(s) may be provided in one prompt, got {count} "
                f"(server flag --limit-mm-per-prompt)"
            )
