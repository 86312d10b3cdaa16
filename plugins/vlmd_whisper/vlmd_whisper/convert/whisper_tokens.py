"""Whisper's special tokens and the tokenizer files a converted checkpoint needs.

OpenAI's vocabulary: byte-level BPE (GPT-2's for English-only models), then
``<|endoftext|>``, ``<|startoftranscript|>``, the language tokens, ``<|translate|>``,
``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``, ``<|nocaptions|>``,
``<|notimestamps|>`` and 1,501 timestamps ``<|0.00|>`` .. ``<|30.00|>``. A vocabulary of
51,865 tokens or more is multilingual (OpenAI's rule); 51,864 is English-only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MULTILINGUAL_MIN_VOCAB = 51865
EOT = "<|endoftext|>"
_LANGUAGE = re.compile(r"^<\|([a-z]{2,3})\|>$")
_TIMESTAMP = re.compile(r"^<\|\d+\.\d\d\|>$")


def whisper_special_ids(vocabulary: list[str]) -> dict:
    """Ids of the control tokens, the language table and whether the model is multilingual."""
    index = {token: i for i, token in enumerate(vocabulary)}
    names = {
        "eos": EOT, "sot": "<|startoftranscript|>", "translate": "<|translate|>",
        "transcribe": "<|transcribe|>", "prev_sot": "<|startofprev|>", "no_timestamps": "<|notimestamps|>",
        "timestamp_begin": "<|0.00|>",
    }
    missing = [token for token in names.values() if token not in index]
    if missing:
        raise ValueError(f"vocabulary.txt lacks Whisper's special tokens {missing}")
    ids: dict = {key: index[token] for key, token in names.items()}
    if ids["timestamp_begin"] != ids["no_timestamps"] + 1:
        raise ValueError("timestamps must follow <|notimestamps|> directly")
    languages = vocabulary[ids["sot"] + 1 : ids["translate"]]
    if not all(_LANGUAGE.match(token) for token in languages):
        raise ValueError("the tokens between <|startoftranscript|> and <|translate|> are not all languages")
    ids["lang_to_id"] = {token: ids["sot"] + 1 + offset for offset, token in enumerate(languages)}
    ids["multilingual"] = len(vocabulary) >= MULTILINGUAL_MIN_VOCAB
    return ids


def write_tokenizer(tokenizer_json: Path, vocabulary: list[str], target: Path) -> None:
    """``tokenizer.json`` with every vocabulary token, plus transformers' config files.

    The BPE vocabulary and the added tokens already in ``tokenizer.json`` must agree with
    ``vocabulary.txt`` id for id; tokens past them (the timestamps) are appended as special
    added tokens, so detokenizers skip them like the other control tokens.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    known: dict[int, str] = {int(i): t for t, i in data["model"]["vocab"].items()}
    known.update({int(added["id"]): added["content"] for added in data.get("added_tokens", [])})
    for token_id, token in known.items():
        if token_id >= len(vocabulary) or vocabulary[token_id] != token:
            raise ValueError(f"tokenizer.json and vocabulary.txt disagree at id {token_id}")
    if set(known) != set(range(len(known))):
        raise ValueError("tokenizer.json has gaps in its token ids")
    for added in data.get("added_tokens", []):
        if added["content"].startswith("<|") and not added.get("special", False):
            raise ValueError(f"control token {added['content']} is not marked special")
    for token_id in range(len(known), len(vocabulary)):
        token = vocabulary[token_id]
        if not _TIMESTAMP.match(token):
            raise ValueError(f"vocabulary.txt id {token_id} ({token!r}) is neither in tokenizer.json nor a timestamp")
        data["added_tokens"].append(
            {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        )
    (target / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    # Named so transformers lists them in all_special_ids (as openai/whisper-* configs do);
    # the timestamps are special to the tokenizer but, as there, not listed.
    controls = [vocabulary[i] for i in range(len(vocabulary)) if vocabulary[i].startswith("<|") and not _TIMESTAMP.match(vocabulary[i])]
    config = {
        **special,
        "additional_special_tokens": [token for token in controls if token != EOT],
        "tokenizer_class": "WhisperTokenizer",
        "add_prefix_space": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 1024,
    }
    for name, body in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (target / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
