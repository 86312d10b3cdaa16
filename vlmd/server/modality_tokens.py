"""Prompt tokens per modality: how many of a prompt's tokens its images, videos and audio
clips cost, for ``usage.prompt_tokens_details.multimodal_tokens``.

The shape is vLLM's (PR #45458, ``PromptTokenUsageInfo.multimodal_tokens``): a map from
modality name to tokens, a breakdown of the placeholder tokens already counted in
``prompt_tokens``, left out when the prompt has no media. Clients that read vLLM's usage read
ours. The counts are the placeholder runs the family's processor produced
(``MultiModalItem.length``), the tokens the items occupy in the context: the same numbers
``vlmd cost`` prints as ``placeholder_tokens``, never the encoder's own output size (an
encoder-decoder's audio window has no placeholders and costs no prompt tokens).

The same counts are also written in OpenAI's typed fields (``openai_token_details``), which
the official client's ``PromptTokensDetails`` reads: ``text_tokens``, ``image_tokens``,
``audio_tokens``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable

from vlmd.types import MultiModalItem


def multimodal_token_counts(items: Iterable[MultiModalItem]) -> dict[str, int]:
    """Placeholder tokens per modality, in the order the modalities first appear; only
    modalities that hold prompt positions."""
    counts: dict[str, int] = {}
    for item in items:
        if item.length > 0:
            counts[item.modality] = counts.get(item.modality, 0) + item.length
    return counts


def merged_counts(per_prompt: Iterable[dict[str, int]]) -> dict[str, int]:
    """The counts of several prompts (a batch of text completions) added up."""
    total: dict[str, int] = {}
    for counts in per_prompt:
        for modality, tokens in counts.items():
            total[modality] = total.get(modality, 0) + tokens
    return total


# OpenAI's typed fields of ``usage.prompt_tokens_details`` for vlmd's modalities. Video has
# none (OpenAI's API takes no video): its tokens are in ``multimodal_tokens`` only, and
# neither in ``text_tokens`` nor in the others.
OPENAI_TOKEN_FIELDS = {"image": "image_tokens", "audio": "audio_tokens"}


def openai_token_details(prompt_tokens: int, counts: dict[str, int]) -> dict[str, int]:
    """OpenAI's spelling of the per-modality counts (D101): ``text_tokens`` (the prompt's
    tokens that are no item's placeholders), ``image_tokens`` and ``audio_tokens``, each
    present, 0 where the prompt has none (as OpenAI's API writes ``audio_tokens: 0``)."""
    details = {"text_tokens": prompt_tokens - sum(counts.values())}
    for modality, field in OPENAI_TOKEN_FIELDS.items():
        details[field] = counts.get(modality, 0)
    return details
