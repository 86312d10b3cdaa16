"""Prompt tokens per modality: how many of a prompt's tokens its images, videos and audio
clips cost, for ``usage.prompt_tokens_details.multimodal_tokens``.

The shape is vLLM's (PR #45458, ``PromptTokenUsageInfo.multimodal_tokens``): a map from
modality name to tokens, a breakdown of the placeholder tokens already counted in
``prompt_tokens``, left out when the prompt has no media. Clients that read vLLM's usage read
ours. The counts are the placeholder runs the family's processor produced
(``MultiModalItem.length``), the tokens the items occupy in the context: the same numbers
``vlmd cost`` prints as ``placeholder_tokens``, never the encoder's own output size (an
encoder-decoder's audio window has no placeholders and costs no prompt tokens). Torch-free.
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
