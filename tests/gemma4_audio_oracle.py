"""transformers' Gemma 4 with audio as the reference (float32). Not a test module.

The inputs are assembled as ``Gemma4Processor.__call__`` assembles them, from its parts (the
whole processor needs a video processor, torchvision, to load): the chat template's prompt,
``Gemma4AudioFeatureExtractor`` (the checkpoint's settings) over the clips as one batch, each
``<|audio|>`` replaced by ``<|audio>`` + n x ``<|audio|>`` + ``<audio|>`` with n counted as
``replace_audio_token`` counts it (the extractor's frame mask after two stride-2 halvings),
and the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from gemma4_oracle import load_hf_gemma4
from oracle import _greedy


def replace_audio_token_count(mask) -> int:
    """transformers' ``Gemma4Processor.replace_audio_token``: the mask through two stride-2 convs."""
    length = len(mask)
    for _ in range(2):
        out = (length + 2 - 3) // 2 + 1
        mask = mask[::2][:out]
        length = len(mask)
    return int(mask.sum())


def gemma4_audio_inputs(model_dir, messages, clips) -> dict:
    import numpy as np
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    _, tokenizer = load_hf_gemma4(str(Path(model_dir).resolve()))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    settings = json.loads((Path(model_dir) / "processor_config.json").read_text())["feature_extractor"]
    settings = {key: value for key, value in settings.items() if key != "feature_extractor_type"}
    extracted = Gemma4AudioFeatureExtractor(**settings)([np.asarray(clip, np.float32) for clip in clips],
                                                        return_tensors="pt")
    audio, boa, eoa = tokenizer.audio_token, tokenizer.boa_token, tokenizer.eoa_token
    parts = prompt.split(audio)
    if len(parts) != len(clips) + 1:
        raise ValueError(f"{len(parts) - 1} audio markers for {len(clips)} clips")
    counts = [replace_audio_token_count(mask.numpy()) for mask in extracted["input_features_mask"]]
    text = parts[0] + "".join(f"{boa}{audio * count}{eoa}{part}" for count, part in zip(counts, parts[1:]))
    inputs = dict(tokenizer(text, return_tensors="pt", add_special_tokens=False))
    inputs.update(input_features=extracted["input_features"], input_features_mask=extracted["input_features_mask"])
    return inputs


def hf_gemma4_audio_generate(model_dir, messages, clips, max_new_tokens: int) -> dict:
    """Greedy generate: prompt ids, output ids, top-1/top-2 gaps and the greedy tokens' log-probs."""
    import torch

    model, _ = load_hf_gemma4(str(Path(model_dir).resolve()))
    inputs = gemma4_audio_inputs(model_dir, messages, clips)
    output_ids, gaps, logits = _greedy(model, inputs, max_new_tokens)
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[token]) for step, token in zip(logits, output_ids)]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "output_token_ids": output_ids, "gaps": gaps,
            "logprobs": logprobs}
