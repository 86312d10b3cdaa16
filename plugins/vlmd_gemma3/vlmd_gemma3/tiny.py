"""Deterministic random Gemma 3 checkpoints for tests (``Gemma3ForConditionalGeneration``).

Written from transformers' own config classes, loadable offline by transformers and vlmd:
``config.json``, ``model.safetensors`` (float32), a Gemma-style tokenizer (``vlmd/tiny/gemma_tokenizer.py``:
SentencePiece-style BPE with byte fallback, single-token newline runs, Gemma's special
tokens and ids, so vLLM's Gemma 3 processor loads it too) with Gemma 3's chat template,
``preprocessor_config.json`` / ``processor_config.json`` (PIL image
processor, pan-and-scan settings) and ``vlmd_tiny.json``.

The tiny decoder keeps what makes Gemma 3 different, at sizes that make tests exercise it:
a sliding window of 24 tokens (shorter than a test prompt, not a multiple of a KV block)
on every other layer, query/key norms, a query scale that is not 1/sqrt(head_dim), two
rotary tables (a linear-scaled one on the full layers), embeddings scaled by sqrt(hidden)
(untied from the output here: a tied random model only repeats its input token). The SigLIP tower sees 64-px images as 16x16 patches, pooled 4x4 to 16 tokens.
The tiny decoder's heads are 32 wide (its attention, 4 x 32, is wider than its 64-wide
hidden state; Gemma's head_dim is set apart from its hidden size): vLLM-CPU 0.32's paged
attention takes head sizes from 32 up only, and the tiny checkpoint is measured against it
too (contrib/bench/side_by_side.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model
from vlmd.tiny.gemma_tokenizer import LEADING_SPECIAL_TOKENS, TRAILING_SPECIAL_TOKENS, build_gemma_tokenizer

__all__ = ["GEMMA3_CHAT_TEMPLATE", "SIZES", "build_tiny_gemma3", "gemma3_config"]

SPECIAL_TOKENS = (*LEADING_SPECIAL_TOKENS, *TRAILING_SPECIAL_TOKENS)
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "image_size": 64, "patch_size": 4, "mm_tokens_per_image": 16,
        "vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        "text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=24,
                     sliding_window_pattern=2, max_position_embeddings=4096),
    },
    "small": {
        "vocab_size": 8192,
        "image_size": 224, "patch_size": 14, "mm_tokens_per_image": 64,
        "vision": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=6),
        "text": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                     sliding_window_pattern=6, max_position_embeddings=8192),
    },
}
PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}

# Gemma 3's chat template, after google/gemma-3-4b-it's (bos, system prefix, model role, image marker).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

_EXTRA_WORDS = ("user", "model", "What", "Describe", "image", "Here", "is", "the", "original", "and", "here",
                "are", "some", "crops", "to", "help", "you", "see", "better")


def _build_tokenizer(seed: int, vocab_size: int):
    return build_gemma_tokenizer(
        seed=seed, vocab_size=vocab_size, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(
            bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
            extra_special_tokens=IMAGE_TOKENS,
            model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
            chat_template=GEMMA3_CHAT_TEMPLATE,
        ),
    )


def gemma3_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    from transformers import Gemma3Config

    spec = SIZES[size]
    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
            bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
            tie_word_embeddings=False, **spec["text"],
        ),
        vision_config=dict(image_size=spec["image_size"], patch_size=spec["patch_size"], layer_norm_eps=1e-6,
                           vision_use_head=False,
                           **spec["vision"]),
        mm_tokens_per_image=spec["mm_tokens_per_image"],
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], tie_word_embeddings=False,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


_COMMON_STD = StdRule()


def _param_std(name: str, shape: tuple[int, ...], is_norm: bool) -> tuple[float, float]:
    """vlmd.tiny.weights' common rule, but Gemma's RMSNorms scale by 1 + w, so their weights
    are N(0, 0.1) (the SigLIP tower's LayerNorms keep 1 + N(0, 0.1)), and the image projection
    is stored [in, out], so its fan-in is its first dimension."""
    if "norm" in name and name.endswith("weight") and len(shape) == 1:
        return (0.0, 0.1) if "vision_tower" not in name else (1.0, 0.1)
    if name.endswith("mm_input_projection_weight"):
        return 0.0, 1.0 / math.sqrt(shape[0])
    return _COMMON_STD(name, shape, is_norm)


def _write_processor_files(out: Path, tokenizer, spec: dict) -> None:
    write_tokenizer(out, tokenizer, GEMMA3_CHAT_TEMPLATE, extra_special_tokens=IMAGE_TOKENS)
    image = {
        "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_normalize": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "resample": 2, "rescale_factor": 1 / 255, "size": {"height": spec["image_size"], "width": spec["image_size"]},
        "do_pan_and_scan": False, **PAN_AND_SCAN,
    }
    write_json(out / "preprocessor_config.json", {**image, "processor_class": "Gemma3Processor"})
    write_json(out / "processor_config.json", {"processor_class": "Gemma3Processor", "image_processor": image,
                                                "image_seq_length": spec["mm_tokens_per_image"]})


def build_tiny_gemma3(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Gemma 3 checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import Gemma3ForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = gemma3_config(size, vocab_size=len(tokenizer), ids=ids)
    model = random_model(Gemma3ForConditionalGeneration, config, seed, _param_std, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<eos>"], ids["<end_of_turn>"]]
    save_checkpoint(model, out, ids["<bos>"], eos_ids, ids["<pad>"])
    _write_processor_files(out, tokenizer, spec)
    write_json(out / "vlmd_tiny.json", {
        "family": "gemma3", "size": size, "seed": int(seed), "num_parameters": int(num_params),
        "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<pad>"],
        "image_token_id": ids["<image_soft_token>"], "boi_token_id": ids["<start_of_image>"],
        "eoi_token_id": ids["<end_of_image>"], "sliding_window": spec["text"]["sliding_window"],
        "mm_tokens_per_image": spec["mm_tokens_per_image"],
    })
    return out
