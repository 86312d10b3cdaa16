"""Writing a built checkpoint's files the same way every time, for every tiny-checkpoint builder.

Same seed and size, same bytes (``vlmd.tiny``): the weights go out as float32 safetensors with
stable file modes; every JSON file goes through :func:`write_json` (sorted keys, so the bytes do
not depend on the order transformers or a builder inserted them); the tokenizer's config is
rewritten in the spelling both transformers 4.x and 5.x read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["finish_tokenizer_config", "restamp_json", "save_model", "write_json", "write_tokenizer"]


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


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON with sorted keys, 2-space indents, UTF-8 and a final newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def restamp_json(out: Path, *names: str) -> None:
    """Rewrite JSON files transformers wrote (``config.json``, ``generation_config.json``...)
    through :func:`write_json`, so their bytes stay the same across builds."""
    for name in names:
        path = Path(out) / name
        write_json(path, json.loads(path.read_text(encoding="utf-8")))


def finish_tokenizer_config(
    out: Path,
    chat_template: str,
    *,
    extra_special_tokens: Mapping[str, str] | None,
    additional_special_tokens: Sequence[str] | None = None,
) -> dict:
    """Rewrite the saved ``tokenizer_config.json`` so transformers 4.x and 5.x read it alike;
    return what was written.

    - ``tokenizer_class``: 5.x writes "TokenizersBackend", which 4.x does not know; both map
      "PreTrainedTokenizerFast" to their tokenizers-backed class.
    - ``extra_special_tokens``: 5.x writes a list there, which 4.x rejects; both read a dict
      of named tokens (which also gives ``tokenizer.image_token``). ``None`` drops the key.
    - ``additional_special_tokens``: the list 4.x wants (left as saved when ``None``).
    - no automatic bos/eos: chat templates write what they need.
    """
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if extra_special_tokens is None:
        config.pop("extra_special_tokens", None)
    else:
        config["extra_special_tokens"] = dict(extra_special_tokens)
    if additional_special_tokens is not None:
        config["additional_special_tokens"] = list(additional_special_tokens)
    config["chat_template"] = chat_template
    config["add_bos_token"] = False
    config["add_eos_token"] = False
    write_json(path, config)
    return config


def write_tokenizer(
    out: Path,
    tokenizer,
    chat_template: str,
    *,
    extra_special_tokens: Mapping[str, str] | None,
    additional_special_tokens: Sequence[str] | None = None,
) -> None:
    """The tokenizer's files (``save_pretrained``, then :func:`finish_tokenizer_config`) and
    ``chat_template.jinja``."""
    tokenizer.save_pretrained(out)
    finish_tokenizer_config(out, chat_template, extra_special_tokens=extra_special_tokens,
                            additional_special_tokens=additional_special_tokens)
    (Path(out) / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def save_checkpoint(model, out: Path, bos_token_id: int, eos_token_ids: list[int], pad_token_id: int) -> None:
    """The model with the generation config greedy tests stop by (its bos, eos and pad
    ids), saved by :func:`save_model`, its two JSON files restamped by :func:`restamp_json`."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(bos_token_id=bos_token_id, eos_token_id=eos_token_ids,
                                               pad_token_id=pad_token_id)
    save_model(model, out)
    restamp_json(out, "config.json", "generation_config.json")
