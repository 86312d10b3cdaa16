"""transformers' Gemma 4 as the reference (float32). Not a test module."""

from __future__ import annotations

import functools
from pathlib import Path

from oracle import _greedy


@functools.lru_cache(maxsize=2)
def load_hf_gemma4(model_dir: str):
    import torch
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_gemma4_generate(model_dir, messages, max_new_tokens: int) -> dict:
    """Greedy generate from the chat template's prompt: prompt ids, output ids, top-1/top-2
    gaps and the greedy tokens' log-probs."""
    import torch

    model, tokenizer = load_hf_gemma4(str(Path(model_dir).resolve()))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    output_ids, gaps, logits = _greedy(model, dict(inputs), max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
