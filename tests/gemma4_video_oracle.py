"""transformers' Gemma 4 on a video as the reference (float32). Not a test module.

transformers' ``Gemma4VideoProcessor`` needs torchvision, which does not import beside the
torch here. Its module is loaded from transformers' own file with torchvision's functional
API stood in by the two calls it makes on this path (``video_processor_standin``): ``resize``
of a uint8 ``[frames, 3, H, W]`` tensor, bicubic, antialiased, which on the CPU is torch's
uint8 kernel (``torch.nn.functional.interpolate``; torchvision calls it for uint8 bicubic
there, ``_do_native_uint8_resize_on_cpu``), and ``normalize`` ((x - mean) / std, the fused
rescale). Everything else is transformers' code: the frame sampler
(``default_sample_indices_fn``), the aspect-ratio-preserving size, the rescale, the
patchify, the positions and padding; the prompt is ``Gemma4Processor.replace_video_token``'s
and ``ProcessorMixin.get_text_with_replacements``' (called on a stand-in ``self`` that has
the tokenizer's media tokens: the whole processor needs the video processor to load), then
``Gemma4ForConditionalGeneration.generate`` on ``pixel_values_videos``,
``video_position_ids`` and ``num_frames_per_video``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

from gemma4_oracle import load_hf_gemma4
from oracle import _greedy


def _resize(image, size, interpolation=None, antialias=True):
    import torch

    if interpolation != 3:  # PILImageResampling.BICUBIC, as the processor passes it without torchvision
        raise AssertionError(f"the stand-in resizes bicubic only, not {interpolation!r}")
    if image.dtype != torch.uint8 or not antialias:
        raise AssertionError("the stand-in is torchvision's uint8 antialiased CPU path only")
    return torch.nn.functional.interpolate(image, size=list(size), mode="bicubic", antialias=True, align_corners=False)


def _normalize(tensor, mean, std, inplace=False):
    import torch

    mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
    return tensor.sub(mean).div(std)  # torchvision's normalize: sub_(mean).div_(std)


def _grayscale_to_rgb(video):
    if video.shape[-3] != 3:
        raise AssertionError("the stand-in takes RGB frames only")
    return video


@functools.lru_cache(maxsize=1)
def video_processor_standin():
    """transformers' ``video_processing_gemma4`` module, loaded from its file with the stand-in
    ``tvF`` (module docstring)."""
    import transformers.image_processing_backends as backends
    import transformers.models.gemma4 as package
    import transformers.video_processing_utils as video_utils

    stand_in = types.SimpleNamespace(resize=_resize, normalize=_normalize, grayscale_to_rgb=_grayscale_to_rgb,
                                     InterpolationMode=types.SimpleNamespace(BICUBIC=3))
    backends.tvF = stand_in
    video_utils.tvF = stand_in
    spec = importlib.util.spec_from_file_location("transformers.models.gemma4.video_processing_gemma4_standin",
                                                  Path(package.__path__[0]) / "video_processing_gemma4.py")
    module = importlib.util.module_from_spec(spec)
    module.tvF = stand_in
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def video_processor(model_dir, num_frames: int):
    settings = json.loads((Path(model_dir) / "processor_config.json").read_text())["video_processor"]
    keep = ("patch_size", "pooling_kernel_size", "max_soft_tokens", "do_normalize", "image_mean", "image_std",
            "rescale_factor", "resample")
    return video_processor_standin().Gemma4VideoProcessor(num_frames=num_frames,
                                                          **{key: settings[key] for key in keep})


def processor_self(tokenizer):
    """What ``Gemma4Processor``'s prompt methods read of ``self``."""
    from transformers.processing_utils import ProcessorMixin

    stand_in = types.SimpleNamespace(boi_token=tokenizer.boi_token, eoi_token=tokenizer.eoi_token,
                                     image_token=tokenizer.image_token, video_token="<|video|>", audio_token=None,
                                     all_special_multimodal_tokens=[tokenizer.image_token, "<|video|>"])
    stand_in.get_text_with_replacements = types.MethodType(ProcessorMixin.get_text_with_replacements, stand_in)
    return stand_in


def video_replacements(tokenizer, processed) -> list[str]:
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    stand_in = processor_self(tokenizer)
    return [Gemma4Processor.replace_video_token(stand_in, processed, index)
            for index in range(len(processed["num_soft_tokens_per_video"]))]


def gemma4_video_inputs(model_dir, messages, videos, metadata, num_frames: int) -> dict:
    """The processor's inputs for ``messages`` with ``videos`` (every decoded frame, and
    ``metadata``: total_num_frames and fps each)."""
    import torch

    _, tokenizer = load_hf_gemma4(str(Path(model_dir).resolve()))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    processed = video_processor(model_dir, num_frames)(videos=list(videos), video_metadata=list(metadata),
                                                       return_tensors="pt", return_metadata=True)
    [text], _ = processor_self(tokenizer).get_text_with_replacements(
        [prompt], videos_replacements=video_replacements(tokenizer, processed))
    inputs = dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))
    inputs.update(pixel_values_videos=processed["pixel_values_videos"],
                  video_position_ids=processed["video_position_ids"],
                  num_frames_per_video=torch.as_tensor(processed["num_frames_per_video"]))
    # create_mm_token_type_ids: video soft tokens are type 2.
    inputs["mm_token_type_ids"] = 2 * (inputs["input_ids"] == tokenizer.convert_tokens_to_ids("<|video|>")).long()
    return inputs


def hf_gemma4_video_generate(model_dir, messages, videos, metadata, num_frames: int, max_new_tokens: int) -> dict:
    """Greedy generate: prompt ids, output ids, top-1/top-2 gaps and the greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_gemma4(str(Path(model_dir).resolve()))
    inputs = gemma4_video_inputs(model_dir, messages, videos, metadata, num_frames)
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
