"""The tiny checkpoints' tokenizer builder, under its former name (docs/decisions.md D72
cites it so); it lives in ``vlmd/tiny/tokenizer_builder.py``, which ``vlmd serve`` uses to
build its embedded default."""

from vlmd.tiny.tokenizer_builder import (  # noqa: F401
    ALLOWED_BYTES,
    build_bpe_tokenizer,
    byte_alphabet,
    bytes_to_unicode,
    synthetic_corpus,
)

__all__ = ["ALLOWED_BYTES", "build_bpe_tokenizer", "byte_alphabet", "bytes_to_unicode", "synthetic_corpus"]
