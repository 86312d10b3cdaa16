"""transformers reference ("oracle") helpers for parity tests.  Not a test module.

Everything runs in float32 with the PIL image-processing backend (torchvision is not
installed and must not be), offline; on the CPU, or where ``VLMD_ORACLE_DEVICE`` says
(``cuda``: contrib/device/check.sh compares vlmd and transformers on one GPU; TF32 off).

    ref = hf_llava_generate(model_dir, messages, [image], max_new_tokens=16)
    assert_greedy_match(our_token_ids, ref)
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = [
    "load_hf_llava",
    "hf_llava_generate",
    "load_hf_qwen2_vl",
    "hf_qwen2_vl_generate",
    "assert_greedy_match",
    "top2_gap",
]


def _key(model_dir) -> str:
    return str(Path(model_dir).resolve())


@functools.lru_cache(maxsize=4)
def _load_hf_llava_cached(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    # Force the PIL/NumPy image processor (CLIPImageProcessorPil).  Passing backend="pil" to
    # AutoProcessor.from_pretrained also works, but it forwards the kwarg to the tokenizer too and
    # sets tokenizer.backend = "pil"; loading the image processor on its own avoids that.
    processor.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert processor.image_processor.backend == "pil", type(processor.image_processor)
    return model, processor


def load_hf_llava(model_dir):
    """(model in float32 eval mode, LlavaProcessor with the PIL image processor), cached per dir."""
    return _load_hf_llava_cached(_key(model_dir))


def top2_gap(logits) -> float:
    """Top-1 minus top-2 log-probability of a 1-D logits tensor (computed in float32)."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, 2).values
    return float(top[0] - top[1])


ORACLE_DEVICE_ENV = "VLMD_ORACLE_DEVICE"


def oracle_device() -> str:
    """Where transformers' references run: ``$VLMD_ORACLE_DEVICE``, else the CPU."""
    return os.environ.get(ORACLE_DEVICE_ENV, "cpu")


def on_oracle_device(model):
    """``model`` moved to ``oracle_device()`` (once: the loaders cache it), and that device.
    On CUDA TF32 is turned off: float32 means float32, as vlmd's server sets it
    (engine/builder.py)."""
    import torch

    device = torch.device(oracle_device())
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model.to(device)
    return device


def _greedy(model, inputs, max_new_tokens: int):
    """transformers' greedy generate: (output ids, top-1/top-2 gap per step, step logits on
    the CPU), on ``oracle_device()``."""
    import torch

    device = on_oracle_device(model)
    inputs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    config = model.generation_config
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    output_ids = out.sequences[0, prompt_len:].tolist()
    logits = tuple(step_logits.cpu() for step_logits in out.logits)
    gaps = [top2_gap(step_logits[0]) for step_logits in logits]
    # generate() would pad finished rows in a batch; with batch 1 it stops right after eos.
    assert len(gaps) == len(output_ids), (len(gaps), len(output_ids))
    return output_ids, gaps, logits


def hf_llava_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int) -> dict:
    """Greedy generation with transformers.

    ``messages``: chat messages whose content is a string or a list of ``{"type": "text", "text":
    ...}`` / ``{"type": "image"}`` parts; ``images``: PIL images, one per image part, in order.

    Returns ``{"prompt_token_ids", "output_token_ids", "gaps", "prompt"}``: the ids fed to the model
    (``<image>`` already expanded to 576 ids each), the greedy continuation (stops after eos), for
    each generated step the top-1/top-2 log-prob gap of the model's distribution, and the rendered
    prompt text.
    """

    model, processor = load_hf_llava(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=prompt,
        images=list(images) if images else None,
        return_tensors="pt",
        add_special_tokens=False,
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, _ = _greedy(model, inputs, max_new_tokens)
    return {
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": output_ids,
        "gaps": gaps,
    }


class PilFramesVideoProcessor:
    """Stand-in for transformers' ``Qwen2VLVideoProcessor``, which needs torchvision (not
    installable here). Each frame goes through transformers' own ``Qwen2VLImageProcessorPil``
    (PIL bicubic smart resize, rescale, normalise, patchify) with the checkpoint's video pixel
    limits; frame pairs are then joined along the temporal patch axis, which is the layout of
    the video processor's patchify (an odd last frame is repeated, as there).
    """

    def __init__(self, model_dir):
        import json

        from transformers import Qwen2VLImageProcessorPil

        path = Path(model_dir) / "video_preprocessor_config.json"
        settings = json.loads(path.read_text()) if path.exists() else {}
        keep = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size", "image_mean",
                "image_std", "resample")
        self.frame_processor = Qwen2VLImageProcessorPil(**{k: settings[k] for k in keep if k in settings})
        self.merge_size = self.frame_processor.merge_size
        self.temporal_patch_size = self.frame_processor.temporal_patch_size

    def __call__(self, videos, **kwargs):
        import numpy as np
        import torch
        from PIL import Image
        from transformers.image_processing_utils import BatchFeature

        # Of the processor call's video kwargs only a pixel-limit override concerns frames.
        overrides = {"size": kwargs["size"]} if kwargs.get("size") else {}
        patches, grids = [], []
        for video in videos:
            frames = list(video)
            frames += frames[-1:] * (-len(frames) % self.temporal_patch_size)
            per_frame = [
                self.frame_processor(Image.fromarray(np.asarray(frame)), return_tensors="pt", **overrides)
                for frame in frames
            ]
            _, grid_h, grid_w = per_frame[0]["image_grid_thw"][0].tolist()
            p = self.frame_processor.patch_size
            # Each frame's patches hold the frame twice along the temporal axis: keep one copy.
            single = [out["pixel_values"].view(-1, 3, self.temporal_patch_size, p, p)[:, :, 0] for out in per_frame]
            for start in range(0, len(single), self.temporal_patch_size):
                pair = torch.stack(single[start : start + self.temporal_patch_size], dim=2)
                patches.append(pair.reshape(pair.shape[0], -1))
            grids.append([len(frames) // self.temporal_patch_size, grid_h, grid_w])
        return BatchFeature({"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids)})


@functools.lru_cache(maxsize=4)
def _load_hf_qwen2_vl_cached(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # AutoProcessor cannot load Qwen2VLProcessor without torchvision (its video processor);
    # build it from parts, letting the stand-in video processor past the class check.
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
    )
    try:
        processor = Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=PilFramesVideoProcessor(model_dir),
            chat_template=tokenizer.chat_template,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return model, processor


def load_hf_qwen2_vl(model_dir):
    """(Qwen2VLForConditionalGeneration in float32 eval mode, Qwen2VLProcessor with the PIL
    image processor and ``PilFramesVideoProcessor``), cached per directory."""
    return _load_hf_qwen2_vl_cached(_key(model_dir))


def hf_qwen2_vl_generate(
    model_dir,
    messages: list[dict[str, Any]],
    images: list,
    max_new_tokens: int,
    videos: list | None = None,
    mm_processor_kwargs: dict | None = None,
) -> dict:
    """Greedy generation with transformers' Qwen2-VL, as ``hf_llava_generate``.

    ``messages`` use ``{"type": "image"}`` / ``{"type": "video"}`` parts; ``images`` are PIL
    images and ``videos`` arrays of already sampled RGB frames ``[frames, H, W, 3]``, one per
    part, in order. ``mm_processor_kwargs`` (``min_pixels``/``max_pixels``) go to both processors.
    Also returns ``grids``: the image and video ``grid_thw`` rows.
    """
    import torch

    model, processor = load_hf_qwen2_vl(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if mm_processor_kwargs:  # each modality's own limits, with the given ones replaced
        for key, size in (("images_kwargs", processor.image_processor.size),
                          ("videos_kwargs", processor.video_processor.frame_processor.size)):
            kwargs[key] = {"size": {
                "shortest_edge": mm_processor_kwargs.get("min_pixels", size.shortest_edge),
                "longest_edge": mm_processor_kwargs.get("max_pixels", size.longest_edge),
            }}
    inputs = processor(
        text=prompt,
        images=list(images) if images else None,
        videos=list(videos) if videos else None,
        return_tensors="pt",
        add_special_tokens=False,
        **kwargs,
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [
        float(torch.log_softmax(step_logits[0].float(), dim=-1)[token])
        for step_logits, token in zip(logits, output_ids)
    ]
    grids = {key: inputs[key].tolist() for key in ("image_grid_thw", "video_grid_thw") if key in inputs}
    return {
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": output_ids,
        "gaps": gaps,
        "logprobs": logprobs,  # of each greedy token: closeness shows positions are right, not just argmax
        "grids": grids,
        "inputs": inputs,
    }


def assert_greedy_match(ours: list[int], ref: dict, tol: float = 1e-3) -> None:
    """Check our greedy tokens against ``hf_llava_generate``'s.

    Passes if identical, or if the first divergence is at a step where transformers' own top-1 vs
    top-2 log-prob gap is below ``tol`` (a near tie that float32 rounding may legitimately flip;
    everything after such a step is incomparable); that case is reported with a warning.  A length
    difference without a differing token counts as a divergence at the first missing position and
    fails.
    """
    ours = [int(t) for t in ours]
    theirs = [int(t) for t in ref["output_token_ids"]]
    if ours == theirs:
        return
    gaps = ref["gaps"]
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    both_have = i < len(ours) and i < len(theirs) and i < len(gaps)
    if both_have and gaps[i] < tol:
        warnings.warn(
            f"diverged at token {i} where transformers' own top-1/top-2 log-prob gap is {gaps[i]:.3g} < {tol:g}"
            " (accepted as a near tie)",
            stacklevel=2,
        )
        return
    if both_have:
        why = f"diverged at token {i} where transformers' own top-1/top-2 log-prob gap is {gaps[i]:.3g} >= {tol:g}"
    else:
        why = f"lengths differ: ours has {len(ours)} tokens, transformers {len(theirs)} (identical up to token {i})"
    raise AssertionError(
        f"greedy outputs differ: {why}\n"
        f"  ours:         {ours}\n"
        f"  transformers: {theirs}"
    )


def assert_chat_parity(body: dict, ref: dict, atol: float = 1e-3) -> None:
    """A chat answer (``return_token_ids`` and ``logprobs`` on) against transformers' greedy
    reference: the same prompt ids and counts, the greedy tokens by ``assert_greedy_match``,
    and the greedy tokens' log-probs within ``atol`` up to the first divergence (greedy
    tokens can survive a small position error; their log-probs cannot)."""
    import numpy as np

    assert body["prompt_token_ids"] == ref["prompt_token_ids"]
    assert body["usage"]["prompt_tokens"] == len(ref["prompt_token_ids"])
    ours = body["choices"][0]["token_ids"]
    assert body["usage"]["completion_tokens"] == len(ours)
    assert_greedy_match(ours, ref)
    theirs = ref["output_token_ids"]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    logprobs = [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]
    assert np.allclose(logprobs[:same], ref["logprobs"][:same], atol=atol), (logprobs, ref["logprobs"])
