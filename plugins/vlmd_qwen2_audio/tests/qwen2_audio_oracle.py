"""The Qwen2-Audio oracle: transformers' ``Qwen2AudioForConditionalGeneration`` in float32,
greedy, offline (the near-tie rule and ``_greedy`` are the shared ones of tests/oracle.py).
Not a test module."""

from __future__ import annotations

import functools
from typing import Any

from oracle import _greedy, _key


@functools.lru_cache(maxsize=2)
def _load_hf_qwen2_audio_cached(model_dir: str):
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def load_hf_qwen2_audio(model_dir):
    """(Qwen2AudioForConditionalGeneration in float32 eval mode, Qwen2AudioProcessor), cached per dir."""
    return _load_hf_qwen2_audio_cached(_key(model_dir))


def hf_qwen2_audio_generate(model_dir, messages: list[dict[str, Any]], clips: list, max_new_tokens: int) -> dict:
    """Greedy generation with transformers' Qwen2-Audio, as ``hf_llava_generate``.

    ``messages`` use ``{"type": "audio", "audio": ...}`` parts; ``clips`` are float32 16 kHz
    mono arrays, one per part, in order. Note the processor's keyword is ``audio=``
    (``audios=`` is ignored with only a warning). Also returns ``num_audio_tokens`` per clip.
    """
    import torch

    model, processor = load_hf_qwen2_audio(model_dir)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=prompt, audio=list(clips) if clips else None, sampling_rate=16000, return_tensors="pt")
    inputs.pop("num_audio_tokens", None)  # bookkeeping, not a model input
    prompt_ids = inputs["input_ids"][0].tolist()
    # Placeholders per clip, as the processor expanded them: runs of the audio token.
    audio_token, num_audio_tokens, run = model.config.audio_token_id, [], 0
    for token in [*prompt_ids, None]:
        if token == audio_token:
            run += 1
        elif run:
            num_audio_tokens.append(run)
            run = 0
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [
        float(torch.log_softmax(step_logits[0].float(), dim=-1)[token])
        for step_logits, token in zip(logits, output_ids)
    ]
    return {
        "prompt": prompt,
        "prompt_token_ids": prompt_ids,
        "output_token_ids": output_ids,
        "gaps": gaps,
        "logprobs": logprobs,
        "num_audio_tokens": num_audio_tokens,
    }
