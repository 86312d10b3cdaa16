"""transformers' Qwen3-VL as the oracle for the Qwen3-VL tests: float32, PIL image processor,
and transformers' own ``Qwen3VLVideoProcessor`` for video.

That video processor calls torchvision (not installed beside the CPU torch here) three times,
and nothing else of it: ``TorchvisionFreeVideoProcessor`` replaces exactly those calls and
keeps the rest of transformers' code (metadata, frame-count and pixel-limit arithmetic, the
fused rescale and normalisation, patchify, the grid; ``Qwen3VLProcessor`` writes the timestamps
and ``get_rope_index`` the positions):

- the RGB conversion: the frames are RGB already (checked), so it is the identity;
- the resampling at the end of its ``resize``: its own ``smart_resize`` (with the frame cap
  when asked) still picks the size, and the frames must already be at it (checked), so the
  test videos are native size, a multiple of 32 px within the limits;
- ``normalize``: torchvision's ``F.normalize`` on a float tensor, ``(x - mean) / std`` per
  channel, the same two operations.

Frames are sampled by transformers (``sample_fps``: its ``sample_frames`` from every decoded
frame and the source rate in ``VideoMetadata``), or given already sampled with the indices
they were kept at.

Shown equal to the unmodified processor running torchvision (PyPI's torchvision 0.29.1
imported beside torch 2.13.0+cpu after ``../shared/peer/patch_torchvision.py``, outside the
venv), on the tiny checkpoint: native-size videos of 4, 5, 8 and 20 frames give the same
grids and bit-identical patches. Where frames need resizing (a 320x240 video), vlmd's PIL
bicubic and torchvision's differ by at most one uint8 level (0.0078 normalised, 3e-5 on
average) with the same grid.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_processing_utils import BaseVideoProcessor

from oracle import _greedy, _key


class _FramesAtSize(BaseVideoProcessor):
    """Sits between ``Qwen3VLVideoProcessor`` and the torchvision backend in the method
    order: the resampling its ``resize`` ends with must be the identity."""

    def resize(self, image, size, resample=None, **kwargs):
        if tuple(image.shape[-2:]) != (size.height, size.width):
            raise AssertionError(f"the oracle resizes no frames: {tuple(image.shape[-2:])} -> "
                                 f"{(size.height, size.width)}; give frames at the processor's size")
        return image


class TorchvisionFreeVideoProcessor(Qwen3VLVideoProcessor, _FramesAtSize):
    """transformers' ``Qwen3VLVideoProcessor`` with its three torchvision calls replaced (above)."""

    def convert_to_rgb(self, video):
        if video.shape[-3] != 3:
            raise AssertionError(f"the oracle takes RGB frames, not {video.shape[-3]} channels")
        return video

    def normalize(self, image, mean, std, inplace=False, **kwargs):
        import torch

        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        return (image if inplace else image.clone()).sub_(mean).div_(std)


@functools.lru_cache(maxsize=2)
def _load(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    # The class the checkpoint names: Qwen3-VL, or Qwen3-VL-MoE (same processor).
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
    )
    try:
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=TorchvisionFreeVideoProcessor.from_pretrained(model_dir),
                                     chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return model, processor


def load_hf_qwen3_vl(model_dir):
    """(Qwen3VLForConditionalGeneration in float32 eval mode, its processor), cached per directory."""
    return _load(_key(model_dir))


def hf_qwen3_vl_inputs(model_dir, messages: list[dict[str, Any]], images: list, videos: list | None = None,
                       video_metadata: list | None = None, mm_processor_kwargs: dict | None = None,
                       sample_fps: float | None = None):
    """(prompt text, transformers' processor output) for ``messages`` with these items;
    ``video_metadata``: one dict of ``VideoMetadata`` fields per video (None: bare frames);
    ``sample_fps``: transformers samples that many frames per second of each video."""
    _, processor = load_hf_qwen3_vl(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    sampling = {"do_sample_frames": False} if sample_fps is None else {"do_sample_frames": True, "fps": sample_fps}
    kwargs: dict[str, Any] = {"videos_kwargs": sampling}
    if mm_processor_kwargs:
        for key, size in (("images_kwargs", processor.image_processor.size),
                          ("videos_kwargs", processor.video_processor.size)):
            kwargs.setdefault(key, {})["size"] = {
                "shortest_edge": mm_processor_kwargs.get("min_pixels", size.shortest_edge),
                "longest_edge": mm_processor_kwargs.get("max_pixels", size.longest_edge),
            }
    if videos and video_metadata is not None:
        kwargs["videos_kwargs"]["video_metadata"] = list(video_metadata)
    inputs = processor(text=prompt, images=list(images) if images else None,
                       videos=list(videos) if videos else None, return_tensors="pt", add_special_tokens=False,
                       **kwargs)
    inputs.pop("video_metadata", None)
    return prompt, inputs


def hf_qwen3_vl_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int,
                         mm_processor_kwargs: dict | None = None, videos: list | None = None,
                         video_metadata: list | None = None, sample_fps: float | None = None) -> dict:
    """Greedy generation with transformers' Qwen3-VL, as ``oracle.hf_qwen2_vl_generate``:
    prompt and output ids, each step's top-1/top-2 gap and the greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_qwen3_vl(model_dir)
    prompt, inputs = hf_qwen3_vl_inputs(model_dir, messages, images, videos, video_metadata, mm_processor_kwargs,
                                        sample_fps)
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs, "inputs": inputs}
