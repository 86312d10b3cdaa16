"""Writing a built model the same way every time, for every tiny-checkpoint builder."""

from __future__ import annotations

from pathlib import Path


def save_model(model, out: Path) -> None:
    """``save_pretrained`` as float32 safetensors, quietly, with stable file modes."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # transformers writes the weights through a private temp file (mode 0600); make it 0644
    # like every other file so copies and byte-for-byte comparisons see the same thing.
    (Path(out) / "model.safetensors").chmod(0o644)
