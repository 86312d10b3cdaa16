"""transformers reference for Qwen2.5-VL parity tests (float32, PIL backend).  Not a test module.

As ``oracle.hf_qwen2_vl_generate``, with Qwen2.5-VL's model and processor. Video frames go
through ``oracle.PilFramesVideoProcessor`` (transformers' PIL image processor per frame; the
torchvision video processor cannot be installed here) and Qwen2.5-VL's own processor turns each
video's ``VideoMetadata`` (source rate, frame count, sampled indices) into
``second_per_grid_ts`` as it does for any video.

The stand-in against transformers' own ``Qwen2VLVideoProcessor`` (5.19 with torchvision, in the
peer's venv, on this tiny checkpoint): frames already at a multiple of 28 px (the tests' 112x84
video) give the same grid and pixels within 2.4e-7; frames that need a resize differ by up to
0.38 (normalised), torchvision's bicubic against PIL's. vlmd resizes video frames with PIL, as
the PIL image backend does, so the parity videos are native-size.
"""

from __future__ import annotations

import functools
from typing import Any

from oracle import PilFramesVideoProcessor, _greedy, _key


class MetadataPassingVideoProcessor(PilFramesVideoProcessor):
    """The stand-in video processor, returning the videos' metadata as transformers' does
    (``return_metadata``): ``Qwen2_5_VLProcessor`` reads ``sampled_fps`` from it."""

    def __call__(self, videos, video_metadata=None, return_metadata=False, **kwargs):
        from transformers.video_utils import make_batched_metadata

        out = super().__call__(videos, **kwargs)
        out["video_metadata"] = make_batched_metadata(list(videos), video_metadata)
        return out


@functools.lru_cache(maxsize=2)
def _load(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
    )
    try:
        processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        video_processor=MetadataPassingVideoProcessor(model_dir),
                                        chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return model, processor


def load_hf_qwen2_5_vl(model_dir):
    """(Qwen2_5_VLForConditionalGeneration in float32 eval mode, Qwen2_5_VLProcessor), cached."""
    return _load(_key(model_dir))


def hf_qwen2_5_vl_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int,
                           videos: list | None = None, video_metadata: list | None = None,
                           mm_processor_kwargs: dict | None = None) -> dict:
    """Greedy generation with transformers' Qwen2.5-VL; ``video_metadata`` (dicts of
    ``VideoMetadata`` fields, one per video) gives each video's timing. Returns what
    ``oracle.hf_qwen2_vl_generate`` does, with ``second_per_grid_ts``."""
    import torch

    model, processor = load_hf_qwen2_5_vl(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs: dict[str, Any] = {}
    if mm_processor_kwargs:
        for key, size in (("images_kwargs", processor.image_processor.size),
                          ("videos_kwargs", processor.video_processor.frame_processor.size)):
            kwargs[key] = {"size": {
                "shortest_edge": mm_processor_kwargs.get("min_pixels", size.shortest_edge),
                "longest_edge": mm_processor_kwargs.get("max_pixels", size.longest_edge),
            }}
    if videos and video_metadata is not None:
        kwargs.setdefault("videos_kwargs", {})["video_metadata"] = list(video_metadata)
    inputs = processor(text=prompt, images=list(images) if images else None,
                       videos=list(videos) if videos else None, return_tensors="pt", add_special_tokens=False,
                       **kwargs)
    inputs.pop("video_metadata", None)
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(logits, output_ids)]
    return {
        "prompt": prompt,
        "prompt_token_ids": inputs["input_ids"][0].tolist(),
        "output_token_ids": output_ids,
        "gaps": gaps,
        "logprobs": logprobs,
        "second_per_grid_ts": [float(v) for v in inputs.get("second_per_grid_ts", [])],
        "inputs": inputs,
    }
