"""The front-end pipeline for one request: template, tokenize, fetch, decode, process.

Runs on the preprocessing thread pool: nothing here may block the event loop or the
engine thread.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vlmd.config import check_mm_limits
from vlmd.errors import BadRequestError
from vlmd.media.image import load_image
from vlmd.media.policy import MediaPolicy
from vlmd.processing.base import BaseMultiModalProcessor, ProcessorOutput
from vlmd.processing.chat import to_conversation

_LOADERS = {"image": load_image}


class InputPreprocessor:
    def __init__(
        self,
        processor: BaseMultiModalProcessor,
        policy: MediaPolicy,
        mm_limits: dict[str, int],
        max_model_len: int,
    ):
        self.processor = processor
        self.info = processor.info
        self.tokenizer = processor.info.ctx.tokenizer
        self.policy = policy
        self.supported = processor.info.supported_mm_limits()
        # The server flag narrows the model's own limits; it never widens them.
        self.mm_limits = {m: l for m, l in self.supported.items() if l is not None}
        for modality, limit in mm_limits.items():
            self.mm_limits[modality] = min(limit, self.mm_limits.get(modality, limit))
        self.max_model_len = max_model_len
        # Rows of the model's logits: the range of valid token ids in a request.
        hf_config = processor.info.ctx.hf_config
        text_config = getattr(hf_config, "text_config", None) or hf_config
        self.vocab_size = int(getattr(text_config, "vocab_size", None) or len(self.tokenizer))

    def _part_for(self, modality: str) -> dict:
        if modality not in self.supported or modality not in _LOADERS:
            raise BadRequestError(f"this model does not accept {modality} input", param="messages")
        return self.info.chat_part(modality)

    def process_chat(self, messages: Any, mm_processor_kwargs: dict | None = None) -> ProcessorOutput:
        conversation, refs = to_conversation(messages, self._part_for)
        check_mm_limits(Counter(ref.modality for ref in refs), self.mm_limits)
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        media: dict[str, list] = {}
        for ref in refs:
            media.setdefault(ref.modality, []).append(_LOADERS[ref.modality](ref.url, self.policy))
        for modality in self.supported:
            media.setdefault(modality, [])
        output = self.processor.apply(prompt_ids, media, mm_processor_kwargs)
        num_tokens = len(output.prompt_token_ids)
        if num_tokens >= self.max_model_len:
            raise BadRequestError(
                f"the prompt has {num_tokens} tokens (text plus multimodal placeholders) but "
                f"max_model_len is {self.max_model_len}; leave room for at least one output token",
                param="messages",
            )
        return output
