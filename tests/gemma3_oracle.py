"""transformers' Gemma 3 as the reference (float32, PIL image processor). Not a test module.

Pan-and-scan: transformers 5's ``Gemma3Processor`` keeps its own ``do_pan_and_scan=False``
default over a caller's, so with crops the inputs are assembled from its parts: its image
processor (``do_pan_and_scan=True``), its ``replace_image_token`` text and its tokenizer,
and ``token_type_ids`` marking the image tokens, as its ``__call__`` would.
"""

from __future__ import annotations

import functools
from pathlib import Path

from oracle import _greedy


@functools.lru_cache(maxsize=2)
def load_hf_gemma3(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    processor.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return model, processor


def gemma3_inputs(model_dir, messages, images, pan_and_scan: bool = False):
    """The model inputs transformers' processor makes for ``messages`` (with or without crops)."""
    import torch

    model, processor = load_hf_gemma3(str(Path(model_dir).resolve()))
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not images:
        return processor(text=prompt, return_tensors="pt", add_special_tokens=False)
    pixels = processor.image_processor(images=list(images), do_pan_and_scan=pan_and_scan, return_tensors="pt")
    parts = prompt.split(processor.boi_token)
    text = parts[0]
    for index, part in enumerate(parts[1:]):
        text += processor.replace_image_token({"num_crops": pixels["num_crops"].tolist()}, index) + part
    ids = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt")
    token_types = (ids["input_ids"] == processor.tokenizer.image_token_id).long()
    return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
            "pixel_values": pixels["pixel_values"], "token_type_ids": token_types}


def hf_gemma3_generate(model_dir, messages, images, max_new_tokens: int, pan_and_scan: bool = False) -> dict:
    """Greedy generate: prompt ids, output ids, top-1/top-2 gaps and the greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_gemma3(str(Path(model_dir).resolve()))
    inputs = gemma3_inputs(model_dir, messages, images, pan_and_scan)
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
