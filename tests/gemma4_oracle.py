"""transformers' Gemma 4 as the reference (float32, PIL image processor). Not a test module.

The inputs are assembled as ``Gemma4Processor.__call__`` assembles them, from its parts (the
tiny checkpoint has no audio feature extractor for the whole processor to load): the chat
template's prompt, the PIL image processor at the request's ``max_soft_tokens``, each
``<|image|>`` replaced by ``<|image>`` + one ``<|image|>`` per soft token + ``<image|>``
(``replace_image_token``), the tokenizer, and ``mm_token_type_ids`` marking the image
soft tokens (which the model reads where its images attend bidirectionally).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from oracle import _greedy


@functools.lru_cache(maxsize=2)
def load_hf_gemma4(model_dir: str):
    import torch
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def gemma4_inputs(model_dir, messages, images, max_soft_tokens: int | None = None) -> dict:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    _, tokenizer = load_hf_gemma4(str(Path(model_dir).resolve()))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not images:
        return dict(tokenizer(prompt, return_tensors="pt", add_special_tokens=False))
    settings = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    processor = Gemma4ImageProcessorPil(patch_size=settings["patch_size"], pooling_kernel_size=settings["pooling_kernel_size"],
                                        max_soft_tokens=max_soft_tokens or settings["max_soft_tokens"])
    pixels = processor(images=list(images), return_tensors="pt")
    image, boi, eoi = tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token
    parts = prompt.split(image)
    if len(parts) != len(images) + 1:
        raise ValueError(f"{len(parts) - 1} image markers for {len(images)} images")
    text = parts[0] + "".join(f"{boi}{image * int(count)}{eoi}{part}"
                              for count, part in zip(pixels["num_soft_tokens_per_image"], parts[1:]))
    inputs = dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))
    # As the processor marks them (create_mm_token_type_ids): the image soft tokens are type 1.
    token_types = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids(image)).long()
    inputs.update(pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"],
                  mm_token_type_ids=token_types)
    return inputs


def hf_gemma4_generate(model_dir, messages, images, max_new_tokens: int, max_soft_tokens: int | None = None) -> dict:
    """Greedy generate: prompt ids, output ids, top-1/top-2 gaps and the greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_gemma4(str(Path(model_dir).resolve()))
    inputs = gemma4_inputs(model_dir, messages, images, max_soft_tokens)
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
