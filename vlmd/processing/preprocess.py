"""The front-end pipeline for one request: template, tokenize, fetch, decode, process.

Runs on the preprocessing thread pool: nothing here may block the event loop or the
engine thread. Every stage is bounded before it runs: the text by characters (below), each
item by the media policy (bytes, pixels, frames, seconds), all items in flight by the media
lease, and the whole by the deadline, checked between stages.
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
from vlmd.media.budget import MediaLease, decoded_nbytes, encoder_input_nbytes
from vlmd.media.fetch import fetch_bytes
from vlmd.media.image import decode_image, header_size, load_image
from vlmd.media.policy import MediaPolicy
from vlmd.media.video import load_video
from vlmd.processing.base import BaseMultiModalProcessor, ItemSize, ProcessorOutput
from vlmd.media.single_flight import SingleFlight
from vlmd.processing.chat import MediaRef, check_rendered, to_conversation
from vlmd.processing.deadline import NO_DEADLINE, Deadline
from vlmd.processing.embeds import decode_image_embeds
from vlmd.processing.stages import NO_STAGES, PreprocessStages

_LOADERS = {"image": load_image, "video": load_video, "audio": load_audio}
# The content parts that carry an item (processing/chat.py converts them).
MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})


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
        # No token of the tokenizer stands for more characters than its longest vocabulary
        # entry (byte-level BPE and SentencePiece entries hold at least one character per
        # character of text they cover), so a prompt whose text is longer than this cannot
        # fit max_model_len: refused in time linear in the body, before the template and
        # the tokenizer (which needs ~5 s and ~600 MB for 4M characters) see it.
        self.max_token_chars = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_token_chars * max_model_len
        self.single_flight = SingleFlight()
        self.observer = None  # ``observe_fetch(modality, seconds)``, set by the server
        # processing/remote_encoder.py:RemoteEncoders under --encoder-urls, set by the server.
        self.remote_encoders = None

    def _part_for(self, modality: str) -> dict:
        if modality not in self.supported or modality not in _LOADERS:
            raise BadRequestError(
                f"the model `{self.info.ctx.model_id}` does not accept {modality} input", param="messages"
            )
        return self.info.chat_part(modality)

    def _load(self, ref: MediaRef, stages: PreprocessStages = NO_STAGES, length: "PromptLength | None" = None) -> Any:
        """Fetch and decode one item; concurrent loads of one URL share a single fetch. An
        item sent with a ``uuid`` is remembered by it; one sent as a uuid alone is the item
        remembered (vlmd/media/by_uuid.py), or a 400 when there is none."""
        cache = self.processor.cache
        if ref.url is None and ref.embeds is None:
            remembered = cache.by_uuid.recall(ref.modality, ref.uuid) if cache is not None else None
            if remembered is None:
                raise BadRequestError(
                    f"{ref.modality} uuid {ref.uuid!r} is not known to this server: it was never sent with its "
                    f"{ref.modality} here, or has been evicted since; send the item's data or URL with the uuid",
                    param="messages")
            return remembered
        if ref.embeds is not None:
            with stages.stage("decode"):
                item = decode_image_embeds(ref.embeds, ref.where, self.info.encoder_output_width(), self.max_model_len)
        else:
            item = self._fetch_and_decode(ref, stages, length)
        if ref.uuid is not None and cache is not None:
            cache.by_uuid.remember(ref.modality, ref.uuid, item)
        return item

    def _fetch_and_decode(self, ref: MediaRef, stages: PreprocessStages = NO_STAGES,
                          length: "PromptLength | None" = None) -> Any:
        """An image's fetch and decode are timed apart; a video's or audio's loader does both
        at once, timed as its decode. ``length``: an image's header is counted into it before
        the image is decoded."""
        started = time.perf_counter()
        loader = _LOADERS[ref.modality]
        if ref.modality == "audio":  # decoded straight to the rate the model's encoder takes
            rate = getattr(self.processor, "sampling_rate", 16000)
            loader = functools.partial(load_audio, target_rate=rate)
        if ref.modality == "video":  # the frames the family keeps
            loader = functools.partial(load_video, choose=self.choose_frames)

        cache = self.processor.cache
        policy = self.policy

        def decode(data: bytes):
            with stages.stage("decode"):
                return decode_image(data, policy)

        def load():
            if ref.modality != "image":
                with stages.stage("decode"):
                    return loader(ref.url, policy)
            with stages.stage("fetch"):
                data = fetch_bytes(ref.url, policy)
            if length is not None:
                length.add_image(data)
            if cache is None:
                return decode(data)
            return cache.decoded_images.decode(data, decode)  # an upload seen before is not decoded again

        if ref.url.startswith("data:"):
            item = load()
        else:
            item = self.single_flight.do((ref.modality, ref.url), load)
        if self.observer is not None:
            self.observer.observe_fetch(ref.modality, time.perf_counter() - started)
        return item

    def choose_frames(self, total: int, source_fps: float | None) -> list[int]:
        return self.info.video_frame_indices(total, source_fps, self.policy)

    def check_text_length(self, messages: Any) -> None:
        """400 when the messages cannot fit max_model_len tokens, in O(parts), no tokenizing:
        more characters of text than max_model_len tokens can hold, or more messages and
        content parts than max_model_len (every message renders at least its role marker
        and every part at least one token in any real template: the template then only
        ever renders bounded input)."""
        if not isinstance(messages, list):
            return  # to_conversation says what is wrong with it
        total = pieces = 0
        for message in messages:
            pieces += 1
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                pieces += len(content)
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        total += len(text)
        if total > self.max_prompt_chars:
            raise BadRequestError(
                f"the messages hold {total} characters of text, more than {self.max_model_len} tokens "
                f"(max_model_len) can hold: at most {self.max_prompt_chars} characters "
                f"({self.max_token_chars}, the tokenizer's longest token, x {self.max_model_len})",
                param="messages",
            )
        if pieces > self.max_model_len:
            raise BadRequestError(
                f"the messages hold {pieces} messages and content parts; at most max_model_len "
                f"({self.max_model_len}) fit, one token each at least",
                param="messages",
            )

    @staticmethod
    def holds_media(messages: Any) -> bool:
        """Whether the messages may hold an item (any content part but text): such a request
        waits for a media thread (``server/admission.py``, D110). In O(parts), on the loop."""
        if not isinstance(messages, list):
            return True  # to_conversation says what is wrong with it, on any thread
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(part, dict) or part.get("type") != "text"
                                                 for part in content):
                return True
            if content is not None and not isinstance(content, (str, list)):
                return True
        return False

    def chat_prompt_ids(
        self, messages: Any, chat_template_kwargs: dict | None = None, deadline: Deadline = NO_DEADLINE,
        stages: PreprocessStages = NO_STAGES,
    ) -> tuple[list[int], list[MediaRef]]:
        """The templated prompt (one marker per item) and the media references, in order.

        ``vlmd cost`` counts a prompt through this same step, so its figures are the server's.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "this model has no chat template, so it does not serve chat completions "
                "(a speech model is served at /v1/audio/transcriptions)"
            )
        self.check_text_length(messages)
        conversation, refs = to_conversation(messages, self._part_for)
        check_mm_limits(Counter(ref.modality for ref in refs), self.mm_limits)
        template_kwargs = template_variables(self.tokenizer, chat_template_kwargs)
        deadline.check("rendering the chat template")
        def render(conversation: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True, **template_kwargs
            )

        with stages.stage("render"):
            text = render(conversation)
            check_rendered(conversation, render)
            deadline.check("tokenizing")
            return self.tokenizer.encode(text, add_special_tokens=False), refs

    def process_chat(
        self,
        messages: Any,
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        check_length: bool = True,
        deadline: Deadline = NO_DEADLINE,
        lease: MediaLease | None = None,
        stages: PreprocessStages = NO_STAGES,
    ) -> ProcessorOutput:
        """``stages``: where the request's time goes (render, fetch, decode, process)."""
        prompt_ids, refs = self.chat_prompt_ids(messages, chat_template_kwargs, deadline, stages)
        length = PromptLength(self, len(prompt_ids) - len(refs), mm_processor_kwargs) if check_length else None
        media = self._load_all(refs, deadline, lease, stages, length)
        output = self._apply(prompt_ids, media, mm_processor_kwargs, "messages", check_length, deadline, lease,
                             stages)
        # Items sent as a uuid alone have no URL to send on: this server encodes them (it
        # holds their encoder outputs already, unless evicted since their bytes came).
        if self.remote_encoders is not None and output.items and all(ref.url is not None for ref in refs):
            deadline.check("asking the encoder servers")
            self.remote_encoders.attach(output.items, refs, mm_processor_kwargs, deadline)
        return output

    def process_items(
        self, parts: Any, mm_processor_kwargs: dict | None = None,
        deadline: Deadline = NO_DEADLINE, lease: MediaLease | None = None,
    ) -> list:
        """An encoder server's items (``--encoder-only``): media content parts, as a chat
        message holds them, fetched, decoded and processed as a chat request's are (the
        same limits, identifiers and encoder inputs), with no template and no text."""
        if not isinstance(parts, list) or not parts:
            raise BadRequestError("items must be a non-empty list of media content parts", param="items")
        for index, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") not in MEDIA_PART_TYPES:
                raise BadRequestError(
                    f"items[{index}] must be an object whose type is one of {sorted(MEDIA_PART_TYPES)}", param="items")
        _, refs = to_conversation([{"role": "user", "content": parts}], self._part_for)
        check_mm_limits(Counter(ref.modality for ref in refs), self.mm_limits)
        prompt_ids = [self.info.marker_token_id(ref.modality) for ref in refs]
        media = self._load_all(refs, deadline, lease)
        return self._apply(prompt_ids, media, mm_processor_kwargs, "items", False, deadline, lease).items

    def _load_all(self, refs: list[MediaRef], deadline: Deadline, lease: MediaLease | None,
                  stages: PreprocessStages = NO_STAGES, length: "PromptLength | None" = None) -> dict[str, list]:
        media: dict[str, list] = {}
        for index, ref in enumerate(refs):
            deadline.check(f"fetching {ref.modality} {index}")
            item = self._load(ref, stages, length)
            if lease is not None:
                lease.hold(decoded_nbytes(item), f"{ref.modality} {index}")
            media.setdefault(ref.modality, []).append(item)
        return media

    def process_prompt(self, prompt_ids: list[int], check_length: bool = True) -> ProcessorOutput:
        """A text prompt given as token ids (``/v1/completions``): no media, but the same
        checks (a typed media marker without its item is refused by the processor)."""
        if not self.info.accepts_text_only_prompts():
            raise BadRequestError(
                "this model needs an audio input for every prompt; it is served at /v1/audio/transcriptions"
            )
        return self._apply(prompt_ids, {}, None, "prompt", check_length)

    def _apply(
        self, prompt_ids, media: dict, mm_processor_kwargs, param: str, check_length: bool,
        deadline: Deadline = NO_DEADLINE, lease: MediaLease | None = None, stages: PreprocessStages = NO_STAGES,
    ) -> ProcessorOutput:
        for modality in self.supported:
            media.setdefault(modality, [])
        deadline.check("processing the media")
        with stages.stage("process"):
            output = self.processor.apply(prompt_ids, media, mm_processor_kwargs)
        if lease is not None:  # the decoded media go; the encoder inputs stay until the request ends
            lease.settle(encoder_input_nbytes(output.items))
        num_tokens = len(output.prompt_token_ids)
        if check_length and num_tokens >= self.max_model_len:
            raise BadRequestError(
                f"the prompt has {num_tokens} tokens (text plus multimodal placeholders) but "
                f"max_model_len is {self.max_model_len} (--max-model-len); leave room for at least one output token",
                param=param,
            )
        return output


class PromptLength:
    """A chat prompt's tokens as its images arrive: the text's, plus each image's replacement
    tokens, known from its header (``BaseProcessingInfo.item_tokens``, what ``vlmd cost`` counts)
    before it is decoded. A request whose images cannot fit max_model_len is refused when the
    first header that passes it is read: 32 A4 pages are not all decoded and resized to be
    told so (D110). Items without a header (video, audio, embeds, uuids) are counted by the
    processor's output, checked after it as before."""

    def __init__(self, preprocessor: InputPreprocessor, text_tokens: int, mm_processor_kwargs: dict | None):
        self.info = preprocessor.info
        self.max_model_len = preprocessor.max_model_len
        self.kwargs = {**self.info.ctx.mm_processor_kwargs, **(mm_processor_kwargs or {})}
        self.tokens = text_tokens
        self.images = 0

    def add_image(self, data: bytes) -> None:
        size = header_size(data)
        if size is None:
            return  # the decode says what is wrong with it
        self.images += 1
        self.tokens += self.info.item_tokens("image", ItemSize(*size), self.kwargs).replacement
        if self.tokens >= self.max_model_len:
            raise BadRequestError(
                f"the prompt needs at least {self.tokens} tokens with its first {self.images} images (text plus "
                f"their placeholders) but max_model_len is {self.max_model_len} (--max-model-len); leave room for "
                "at least one output token: send fewer or smaller images", param="messages")


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
