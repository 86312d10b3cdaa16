"""Gemma 3 media processing: each image (and pan-and-scan crop) resized to one square, uint8.

The chat template leaves ``<start_of_image>`` per image; transformers' processor replaces
it with ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x ``<image_soft_token>`` +
``<end_of_image>\\n\\n``, and with pan-and-scan crops with "Here is the original image
{that} and here are some crops to help you see better {that} {that} ...". The replacement
here is that text tokenized by the checkpoint's tokenizer (special tokens split it).
Gemma's tokenizer writes a run of up to four newlines as one token, and transformers
tokenizes the expanded text whole, so the "\n" the chat template writes before the marker
and the sequence's "\n\n" are one "\n\n\n" token there (two images in a row: "\n\n\n\n");
the expanded prompt's newline tokens are joined as vLLM's Gemma 3 processor joins them
(``join_newlines``), which gives transformers' ids. Rescale and normalisation happen on the
device (``model.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from PIL import Image

from vlmd.errors import BadRequestError
from vlmd.processing.base import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ItemSize,
    ItemTokens,
    ProcessedItem,
    ProcessorOutput,
)
from vlmd.types import KVSpec
from vlmd_gemma3.layer_kinds import layer_windows
from vlmd_gemma3.settings import ImageSettings, crop_boxes, read_settings


NEWLINE_RUNS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")


def join_newlines(token_ids: list[int], newline_ids: tuple[int, int, int, int]) -> tuple[list[int], list[int]]:
    """``token_ids`` with adjacent newline tokens joined as the tokenizer would have written
    them, and where each old position went: "\n" "\n\n" and "\n\n" "\n" become "\n\n\n",
    "\n\n" "\n\n" becomes "\n\n\n\n", in vLLM's order (three passes, left to right), so both
    servers give the same prompt."""
    one, two, three, four = newline_ids
    ids, where = list(token_ids), list(range(len(token_ids)))
    for pair, joined in (((one, two), three), ((two, one), three), ((two, two), four)):
        out, moved, index = [], [0] * len(ids), 0
        while index < len(ids):
            if index + 1 < len(ids) and (ids[index], ids[index + 1]) == pair:
                moved[index] = moved[index + 1] = len(out)
                out.append(joined)
                index += 2
            else:
                moved[index] = len(out)
                out.append(ids[index])
                index += 1
        ids, where = out, [moved[position] for position in where]
    return ids, where


class Gemma3ProcessingInfo(BaseProcessingInfo):
    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.hf_config
        self.settings = read_settings(ctx.model_dir)
        self.tokens_per_image = int(config.mm_tokens_per_image)
        self.image_token_id = int(config.image_token_index)
        self.boi_token_id = int(config.boi_token_index)
        self.eoi_token_id = int(config.eoi_token_index)
        # Gemma's newline-run tokens, when the tokenizer has all four (a tokenizer without
        # them never writes a run as one token, so there is nothing to join).
        vocab = ctx.tokenizer.get_vocab() if ctx.tokenizer is not None else {}
        self.newline_ids = (tuple(vocab[run] for run in NEWLINE_RUNS)
                            if all(run in vocab for run in NEWLINE_RUNS) else None)

    def supported_mm_limits(self) -> dict[str, int | None]:
        return {"image": None}

    def marker_token_id(self, modality: str) -> int:
        return self.boi_token_id

    def attends_within_items(self) -> bool:
        return True  # an image's tokens attend to each other both ways

    def kv_spec(self) -> KVSpec:
        """The text config's shape, with each layer's sliding window (the windowed layers'
        blocks are counted as they are held: `vlmd cost`, the memory plan)."""
        spec = super().kv_spec()
        return KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, layer_windows(self.ctx.hf_config.text_config))

    def server_settings(self) -> ImageSettings:
        return self.settings.with_kwargs(self.ctx.mm_processor_kwargs)

    @functools.lru_cache(maxsize=16)
    def replacement(self, crops: int) -> tuple[tuple[int, ...], int, int, tuple[tuple[int, int], ...]]:
        """(replacement ids, run start, run end, spans relative to the run start) of an
        image with ``crops`` pan-and-scan crops."""
        tokenizer = self.ctx.tokenizer
        boi, eoi, soft = tokenizer.convert_ids_to_tokens([self.boi_token_id, self.eoi_token_id, self.image_token_id])
        sequence = f"\n\n{boi}{soft * self.tokens_per_image}{eoi}\n\n"
        text = sequence if not crops else (
            f"Here is the original image {sequence} and here are some crops to help you see better "
            + " ".join([sequence] * crops))
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        runs, start = [], None
        for position, token in enumerate(ids + (-1,)):
            if token == self.image_token_id and start is None:
                start = position
            elif token != self.image_token_id and start is not None:
                runs.append((start, position))
                start = None
        if len(runs) != 1 + crops or any(end - first != self.tokens_per_image for first, end in runs):
            raise RuntimeError(f"the tokenizer split an image sequence: runs {runs} for {1 + crops} images")
        first, last = runs[0][0], runs[-1][1]
        return ids, first, last, tuple((a - first, b - first) for a, b in runs)

    def item_tokens(self, modality: str, size: ItemSize, kwargs: dict[str, Any]) -> ItemTokens:
        """An image and its crops: one image sequence each, text between them."""
        crops = len(crop_boxes(size.width, size.height, self.settings.with_kwargs(kwargs)))
        ids, first, last, _ = self.replacement(crops)
        return ItemTokens(replacement=len(ids), placeholders=last - first, encoder_tokens=last - first,
                          layout={"crops": crops} if crops else {})

    def prompt_tokens(self, prompt_token_ids: list[int], items: list[ItemTokens]) -> int:
        """The expanded prompt's length after its newlines are joined (``join_newlines``): one
        fewer for each image right after the chat template's "\n" or after another image."""
        if self.newline_ids is None:
            return super().prompt_tokens(prompt_token_ids, items)
        expanded, markers = [], iter(items)
        for token in prompt_token_ids:
            if token != self.boi_token_id:
                expanded.append(token)
                continue
            item = next(markers, None)
            if item is None:
                raise ValueError("more image markers in the prompt than items")
            expanded.extend(self.replacement(int(item.layout.get("crops", 0)))[0])
        if next(markers, None) is not None:
            raise ValueError("more items than image markers in the prompt")
        return len(join_newlines(expanded, self.newline_ids)[0]) if items else len(expanded)


class Gemma3Processor(BaseMultiModalProcessor):
    def apply(self, prompt_token_ids: list[int], media: dict[str, list[Any]],
              kwargs: dict[str, Any] | None = None) -> ProcessorOutput:
        """The base expansion, then the newlines around the images joined (module docstring);
        a text-only prompt is left as tokenized, as vLLM leaves it."""
        output = super().apply(prompt_token_ids, media, kwargs)
        info: Gemma3ProcessingInfo = self.info
        if info.newline_ids is None or not output.items:
            return output
        ids, where = join_newlines(output.prompt_token_ids, info.newline_ids)
        if len(ids) == len(output.prompt_token_ids):
            return output
        for item in output.items:
            # An item's run is image tokens, which are never joined: its start only moves left.
            item.offset = where[item.offset]
        return ProcessorOutput(ids, output.items, self.family_state(ids, output.items))

    def process_item(self, modality: str, media: Any, kwargs: dict[str, Any]) -> ProcessedItem:
        info: Gemma3ProcessingInfo = self.info
        settings = info.settings.with_kwargs(kwargs)
        server = info.server_settings()
        if settings.do_pan_and_scan and (not server.do_pan_and_scan
                                         or settings.pan_and_scan_max_num_crops > server.pan_and_scan_max_num_crops):
            # The start-up profile and the token budget were sized for the server's setting.
            raise BadRequestError(
                "mm_processor_kwargs: pan-and-scan beyond this server's setting (start it with "
                "--mm-processor-kwargs '{\"do_pan_and_scan\": true}' and at most "
                f"{server.pan_and_scan_max_num_crops} crops)", param="mm_processor_kwargs")
        image = media.convert("RGB")
        boxes = crop_boxes(image.width, image.height, settings)
        ids, first, last, spans = info.replacement(len(boxes))
        pixels = np.empty((1 + len(boxes), 3, settings.size, settings.size), dtype=np.uint8)
        array = np.asarray(image)
        for index, box in enumerate([None] + boxes):
            frame = image if box is None else Image.fromarray(array[box[1]:box[3], box[0]:box[2]])
            if frame.size != (settings.size, settings.size):
                # As transformers' PIL backend: resize the uint8 image, no reducing_gap.
                frame = frame.resize((settings.size, settings.size), resample=settings.resample, reducing_gap=None)
            pixels[index] = np.asarray(frame).transpose(2, 0, 1)
        return ProcessedItem(
            encoder_inputs={"pixels": pixels, "run_ids": list(ids[first:last]), "spans": list(spans)},
            replacement=list(ids), placeholder_offset=first, num_placeholders=last - first,
        )


class Gemma3DummyInputsBuilder(BaseDummyInputsBuilder):
    """The most tokens an image can cost under the server's settings: with pan-and-scan, an
    image wide enough for the most crops; without, any image (all cost the same)."""

    def dummy_item(self, modality: str) -> Any:
        settings = self.info.server_settings()
        side = max(settings.size, settings.pan_and_scan_min_crop_size)
        width = side * settings.pan_and_scan_max_num_crops if settings.do_pan_and_scan else settings.size
        return Image.new("RGB", (width, side if settings.do_pan_and_scan else settings.size), color=(255, 255, 255))
