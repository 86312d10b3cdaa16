"""transformers' Qwen3-VL as the oracle for the Qwen3-VL tests: float32, PIL image processor.

``Qwen3VLProcessor`` asks for a video processor, which in transformers needs torchvision
(not installed beside the CPU torch here); images and text do not use it, so the processor
is built from its parts without one.
"""

from __future__ import annotations

import functools
from typing import Any

from oracle import _greedy, _key


@functools.lru_cache(maxsize=2)
def _load(model_dir: str):
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    assert image_processor.backend == "pil", type(image_processor)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg)
    )
    try:
        processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                     chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
    return model, processor


def load_hf_qwen3_vl(model_dir):
    """(Qwen3VLForConditionalGeneration in float32 eval mode, its processor), cached per directory."""
    return _load(_key(model_dir))


def hf_qwen3_vl_generate(model_dir, messages: list[dict[str, Any]], images: list, max_new_tokens: int,
                         mm_processor_kwargs: dict | None = None) -> dict:
    """Greedy generation with transformers' Qwen3-VL, as ``oracle.hf_qwen2_vl_generate``:
    prompt and output ids, each step's top-1/top-2 gap and the greedy tokens' log-probs."""
    import torch

    model, processor = load_hf_qwen3_vl(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if mm_processor_kwargs:
        size = processor.image_processor.size
        kwargs["images_kwargs"] = {"size": {
            "shortest_edge": mm_processor_kwargs.get("min_pixels", size.shortest_edge),
            "longest_edge": mm_processor_kwargs.get("max_pixels", size.longest_edge),
        }}
    inputs = processor(text=prompt, images=list(images) if images else None, return_tensors="pt",
                       add_special_tokens=False, **kwargs)
    prompt_ids = inputs["input_ids"][0].tolist()
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt": prompt, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs, "inputs": inputs}
