"""The front-end pipeline for one request: template, tokenize, fetch, decode, process.

Runs on the preprocessing thread pool: nothing here may block the event loop or the
engine thread.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from typing import Any

from vlmd.config import check_mm_limits
from vlmd.errors import BadRequestError
from vlmd.media.audio import load_audio
from vlmd.media.image import load_image
from vlmd.media.policy import MediaPolicy
from vlmd.media.video import load_video
from vlmd.processing.base import BaseMultiModalProcessor, ProcessorOutput
from vlmd.media.single_flight import SingleFlight
from vlmd.processing.chat import MediaRef, to_conversation

_LOADERS = {"image": load_image, "video": load_video, "audio": load_audio}


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
            raise BadRequestError(
                f"the model `{self.info.ctx.model_id}` does not accept {modality} input", param="messages"
            )
        return self.info.chat_part(modality)

    def _load(self, ref: MediaRef) -> Any:
        """Fetch and decode one item; concurrent loads of one URL share a single fetch."""
        started = time.perf_counter()
        load = _LOADERS[ref.modality]
        if ref.modality == "audio":  # decoded straight to the rate the model's encoder takes
            rate = getattr(self.processor, "sampling_rate", 16000)
            load = functools.partial(load_audio, target_rate=rate)
        if ref.url.startswith("data:"):
            item = load(ref.url, self.policy)
        else:
            item = self.single_flight.do((ref.modality, ref.url), lambda: load(ref.url, self.policy))
        if self.observer is not None:
            self.observer.observe_fetch(ref.modality, time.perf_counter() - started)
        return item

    def process_chat(
        self, messages: Any, mm_processor_kwargs: dict | None = None, chat_template_kwargs: dict | None = None,
        check_length: bool = True,
    ) -> ProcessorOutput:
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "this model has no chat template, so it does not serve chat completions "
                "(a speech model is served at /v1/audio/transcriptions)"
            )
        conversation, refs = to_conversation(messages, self._part_for)
        check_mm_limits(Counter(ref.modality for ref in refs), self.mm_limits)
        template_kwargs = template_variables(self.tokenizer, chat_template_kwargs)
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        media: dict[str, list] = {}
        for ref in refs:
            media.setdefault(ref.modality, []).append(self._load(ref))
        return self._apply(prompt_ids, media, mm_processor_kwargs, "messages", check_length)

    def process_prompt(self, prompt_ids: list[int], check_length: bool = True) -> ProcessorOutput:
        """A text prompt given as token ids (``/v1/completions``): no media, but the same
        checks (a typed media marker without its item is refused by the processor)."""
        if self.info.ctx.hf_config.is_encoder_decoder:
            raise BadRequestError(
                "this model needs an audio input for every prompt; it is served at /v1/audio/transcriptions"
            )
        return self._apply(prompt_ids, {}, None, "prompt", check_length)

    def _apply(self, prompt_ids, media: dict, mm_processor_kwargs, param: str, check_length: bool) -> ProcessorOutput:
        for modality in self.supported:
            media.setdefault(modality, [])
        output = self.processor.apply(prompt_ids, media, mm_processor_kwargs)
        num_tokens = len(output.prompt_token_ids)
        if check_length and num_tokens >= self.max_model_len:
            raise BadRequestError(
                f"the prompt has {num_tokens} tokens (text plus multimodal placeholders) but "
                f"max_model_len is {self.max_model_len}; leave room for at least one output token",
                param=param,
            )
        return output


def template_variables(tokenizer, chat_template_kwargs: dict | None) -> dict:
    """``chat_template_kwargs`` as extra variables of the template render (e.g. Qwen2-VL's
    ``add_vision_id``). A name that ``apply_chat_template`` itself takes (``tokenize``,
    ``tools``, ``chat_template``...) or that the template is given (``messages``) is
    refused: it would change how we render, not what the template sees."""
    if not chat_template_kwargs:
        return {}
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages", "kwargs"}
    for name in chat_template_kwargs:
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise BadRequestError(
                f"chat_template_kwargs may not set {name!r}: it is not a template variable",
                param="chat_template_kwargs",
            )
    return dict(chat_template_kwargs)
