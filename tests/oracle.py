"""transformers reference ("oracle") helpers for parity tests.  Not a test module.

Everything runs in float32 on CPU with the PIL image-processing backend (torchvision is not
installed and must not be), offline.

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

__all__ = ["load_hf_llava", "hf_llava_generate", "assert_greedy_match", "top2_gap"]


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


def hf_llava_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int) -> dict:
    """Greedy generation with transformers.

    ``messages``: chat messages whose content is a string or a list of ``{"type": "text", "text":
    ...}`` / ``{"type": "image"}`` parts; ``images``: PIL images, one per image part, in order.

    Returns ``{"prompt_token_ids", "output_token_ids", "gaps", "prompt"}``: the ids fed to the model
    (``<image>`` already expanded to 576 ids each), the greedy continuation (stops after eos), for
    each generated step the top-1/top-2 log-prob gap of the model's distribution, and the rendered
    prompt text.
    """
    import torch

    model, processor = load_hf_llava(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=prompt,
        images=list(images) if images else None,
        return_tensors="pt",
        add_special_tokens=False,
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    eos_id = model.generation_config.eos_token_id
    pad_id = model.generation_config.pad_token_id
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    output_ids = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = [top2_gap(step_logits[0]) for step_logits in out.logits]
    # generate() would pad finished rows in a batch; with batch 1 it stops right after eos.
    assert len(gaps) == len(output_ids), (len(gaps), len(output_ids))
    return {
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": output_ids,
        "gaps": gaps,
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
