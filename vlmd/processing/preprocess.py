"""The front-end pipeline for one request: template, tokenize, fetch, decode, process.

Runs on the preprocessing thread pool: nothing here may block the event loop or the
engine thread.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from vlmd.config import check_mm_limits
from vlmd.errors import BadRequestError
from vlmd.media.image import load_image
from vlmd.media.policy import MediaPolicy
from vlmd.media.video import load_video
from vlmd.processing.base import BaseMultiModalProcessor, ProcessorOutput
from vlmd.media.single_flight import SingleFlight
from vlmd.processing.chat import MediaRef, to_conversation

_LOADERS = {"image": load_image, "video": load_video}


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
        self.single_flight = SingleFlight()
        self.observer = None  # ``observe_fetch(modality, seconds)``, set by the server

    def _part_for(self, modality: str) -> dict:
        if modality not in self.supported or modality not in _LOADERS:
            raise BadRequestError(f"this model does not accept {modality} input", param="messages")
        return self.info.chat_part(modality)

    def _load(self, ref: MediaRef) -> Any:
        """Fetch and decode one item; concurrent loads of one URL share a single fetch."""
        started = time.perf_counter()
        load = _LOADERS[ref.modality]
        if ref.url.startswith("data:"):
            item = load(ref.url, self.policy)
        else:
            item = self.single_flight.do((ref.modality, ref.url), lambda: load(ref.url, self.policy))
        if self.observer is not None:
            self.observer.observe_fetch(ref.modality, time.perf_counter() - started)
        return item

    def chat_prompt_ids(self, messages: Any) -> tuple[list[int], list[MediaRef]]:
        """The templated prompt (one marker per item) and the media references, in order.

        ``vlmd cost`` counts a prompt through this same step, so its figures are the server's.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "this model has no chat template, so it does not serve chat completions "
                "(a speech model is served at /v1/audio/transcriptions)"
            )
        conversation, refs = to_conversation(messages, self._part_for)
        check_mm_limits(Counter(ref.modality for ref in refs), self.mm_limits)
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False), refs

    def process_chat(self, messages: Any, mm_processor_kwargs: dict | None = None) -> ProcessorOutput:
        prompt_ids, refs = self.chat_prompt_ids(messages)
        media: dict[str, list] = {}
        for ref in refs:
            media.setdefault(ref.modality, []).append(self._load(ref))
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
