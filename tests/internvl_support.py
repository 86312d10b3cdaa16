"""InternVL test support: the transformers oracle (float32, the PIL image processor). Not a
test module.

transformers' ``InternVLProcessor`` wants a video processor, and ``InternVLVideoProcessor``
imports torchvision (not installed, and vlmd must not need it); the oracle builds the
processor from its parts with ``PilFramesVideoProcessor`` in its place, letting it past the
class check, as ``oracle.py`` does for Qwen2-VL. Images, the prompt's expansion (the "FrameN:"
labels) and the model go through transformers' own code unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


from oracle import _greedy, _key

class PilFramesVideoProcessor:
    """Stand-in for ``InternVLVideoProcessor``: every frame through transformers' own
    ``GotOcr2ImageProcessorPil`` without cropping (a bicubic resize to the video processor's
    size, rescale, normalise with its mean and std), where the original resizes with
    torchvision. Frames are given already sampled; the output is its ``pixel_values_videos``."""

    def __init__(self, model_dir):
        import json

        from transformers import GotOcr2ImageProcessorPil

        settings = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())
        keep = ("size", "image_mean", "image_std", "resample", "rescale_factor")
        self.frame_processor = GotOcr2ImageProcessorPil(**{k: settings[k] for k in keep if k in settings},
                                                        crop_to_patches=False)

    def __call__(self, videos, **kwargs):
        import numpy as np
        import torch
        from PIL import Image
        from transformers.image_processing_utils import BatchFeature

        per_video = [
            self.frame_processor([Image.fromarray(np.asarray(frame)) for frame in video], crop_to_patches=False,
                                 return_tensors="pt")["pixel_values"]
            for video in videos
        ]
        return BatchFeature({"pixel_values_videos": torch.stack(per_video)})


@functools.lru_cache(maxsize=2)
def _load_hf_internvl_cached(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, InternVLForConditionalGeneration, InternVLProcessor
    from transformers.processing_utils import ProcessorMixin

    model = InternVLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
    )
    try:
        processor = InternVLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                      video_processor=PilFramesVideoProcessor(model_dir),
                                      image_seq_length=model.config.image_seq_length,
                                      chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return model, processor


def load_hf_internvl(model_dir):
    """(InternVLForConditionalGeneration in float32 eval mode, InternVLProcessor with the PIL
    GotOcr2 image processor), cached per directory."""
    return _load_hf_internvl_cached(_key(model_dir))


def hf_internvl_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int,
                         mm_processor_kwargs: dict | None = None, videos: list | None = None) -> dict:
    """Greedy generation with transformers' InternVL, as ``oracle.hf_llava_generate``.

    ``messages`` use ``{"type": "image"}`` / ``{"type": "video"}`` parts; ``images`` are PIL
    images and ``videos`` arrays of already sampled RGB frames ``[frames, H, W, 3]``, one per part.
    ``mm_processor_kwargs`` (``min_patches``/``max_patches``) go to the image processor. Also
    returns ``logprobs`` of the greedy tokens and ``num_patches`` (tiles per image).
    """
    import torch

    model, processor = load_hf_internvl(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=list(images) if images else None, videos=list(videos) if videos else None,
                       return_tensors="pt", add_special_tokens=False, **(mm_processor_kwargs or {}))
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(logits, output_ids)]
    num_tiles = len(inputs["pixel_values"]) if images or videos else 0
    return {"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs, "num_tiles": num_tiles}
