"""Llama 3.2 Vision test support: the transformers oracle (float32, the PIL image
processor). Not a test module."""

from __future__ import annotations

import functools
from typing import Any

from oracle import _greedy, _key


@functools.lru_cache(maxsize=2)
def _load_hf_mllama_cached(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, MllamaForConditionalGeneration, MllamaProcessor

    model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template)
    return model, processor


def load_hf_mllama(model_dir):
    """(MllamaForConditionalGeneration in float32 eval mode, MllamaProcessor with the PIL
    image processor), cached per directory."""
    return _load_hf_mllama_cached(_key(model_dir))


def hf_mllama_inputs(model_dir, messages: list[dict[str, Any]], images: list):
    """transformers' processor output for ``messages`` (``{"type": "image"}`` parts, one PIL
    image each, in order), and the rendered prompt."""
    _, processor = load_hf_mllama(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, images=[list(images)] if images else None, return_tensors="pt",
                       add_special_tokens=False)
    return inputs, prompt


def hf_mllama_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int) -> dict:
    """Greedy generation with transformers' Mllama, as ``oracle.hf_llava_generate``; also the
    greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_mllama(model_dir)
    inputs, prompt = hf_mllama_inputs(model_dir, messages, images)
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
