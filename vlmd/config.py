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
    api_key: str | None = None
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


def check_mm_limits(counts: dict[str, int], limits: dict[str, int]) -> None:
    for modality, count in counts.items():
        limit = limits.get(modality)
        if limit is not None and count > limit:
            raise BadRequestError(
                f"at most {limit} {modality}(s) may be provided in one prompt, got {count} "
                f"(server flag --limit-mm-per-prompt)"
            )
