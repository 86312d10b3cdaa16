"""Deterministic random Qwen3-VL checkpoints for tests (``Qwen3VLForConditionalGeneration``).

Built from transformers' own config classes, so the checkpoint has the real architecture:
a ViT over 16-px patches of frame pairs with learned positions (interpolated to each grid),
2D RoPE, a 2x2 merger and one DeepStack merger per ``deepstack_visual_indexes`` entry; a
Qwen3 text model (q/k RMSNorm per head, GQA) with interleaved M-RoPE. Written to ``out_dir``:
``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers 5
names), the tokenizer and chat template (Qwen's special tokens, Qwen3-VL's template for text and images), the image
processor's configs and ``vlmd_tiny.json``. Pixel limits are small (4..64 tokens an image).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from vlmd.tiny.checkpoint_io import save_model

__all__ = ["SIZES", "build_tiny_qwen3_vl", "qwen3_vl_config"]

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 32: resized sides are multiples of this
IMAGE_MIN_PIXELS = 4 * FACTOR * FACTOR
IMAGE_MAX_PIXELS = 64 * FACTOR * FACTOR
HALF = [0.5, 0.5, 0.5]
# Low, as the Qwen2-VL tiny's (see there): every M-RoPE row turns by radians across an image.
ROPE_THETA = 100.0

# After the trained vocabulary, in the order Qwen vocabularies have them.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
_EXTRA_WORDS = ("system", "user", "assistant", "You", "are", "helpful", "What", "Describe", "image", "video")

# Qwen3-VL-Instruct's chat template for text and images (its tool and reasoning branches left
# out): no default system turn, content parts in order.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 1]),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
        "mrope_section": [2, 3, 3],  # sums to head_dim / 2 = 8
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(depth=8, hidden_size=384, intermediate_size=1536, num_heads=6, num_position_embeddings=576,
                       deepstack_visual_indexes=[2, 4, 6]),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
                     num_key_value_heads=4, head_dim=64, max_position_embeddings=8192),
        "mrope_section": [12, 10, 10],  # head_dim 64
    },
}


def _build_tokenizer(seed: int, vocab_size: int):
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, trailing_special_tokens=SPECIAL_TOKENS, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(
            eos_token="<|im_end|>", pad_token="<|endoftext|>",
            extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
            model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
            chat_template=CHAT_TEMPLATE,
        ),
    )


def qwen3_vl_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``Qwen3VLConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import Qwen3VLConfig

    spec = SIZES[size]
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": spec["mrope_section"],
                             "mrope_interleaved": True},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            **spec["text"],
        ),
        vision_config=dict(
            hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE, out_hidden_size=spec["text"]["hidden_size"], **spec["vision"],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    return config


def _param_std(name: str, shape: tuple[int, ...], is_norm: bool, text_hidden: int) -> tuple[float, float]:
    """(mean, std) of the normal distribution a parameter is drawn from."""
    if is_norm:
        return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.02)
    if len(shape) == 1:
        return 0.0, 0.02  # biases
    if name.startswith("lm_head"):
        return 0.0, 2.0 / math.sqrt(text_hidden)
    if name.endswith(("embed_tokens.weight", "pos_embed.weight")):
        return 0.0, 1.0
    fan_in = math.prod(shape[1:])
    if name.endswith(("q_proj.weight", "k_proj.weight", "attn.qkv.weight", "patch_embed.proj.weight")):
        return 0.0, 1.0 / math.sqrt(fan_in)
    if "merger" in name:
        return 0.0, 1.0 / math.sqrt(fan_in)  # image features on the scale of token embeddings
    return 0.0, 0.5 / math.sqrt(fan_in)


def _init_weights(model, seed: int, special_ids: list[int]) -> None:
    """Every parameter from a seeded generator in sorted-name order (fan-in scaled weights,
    unit embeddings, norm weights 1 + N(0, 0.1), biases N(0, 0.02), ``lm_head`` at
    2/sqrt(hidden) so greedy gaps sit far above float32 noise); the ``lm_head`` rows of
    special tokens are zeroed so greedy decoding emits ordinary text."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    norm_names: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
            norm_names.update(f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False))
    text_hidden = model.config.text_config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            mean, std = _param_std(name, tuple(param.shape), name in norm_names, text_hidden)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std + mean)
        model.get_output_embeddings().weight[special_ids] = 0.0


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_processor_files(out: Path, tokenizer) -> None:
    tokenizer.save_pretrained(out)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["extra_special_tokens"] = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok_cfg["additional_special_tokens"] = list(SPECIAL_TOKENS[1:])
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg["add_bos_token"] = False
    tok_cfg["add_eos_token"] = False
    _write_json(tok_cfg_path, tok_cfg)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    image = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": HALF, "image_std": HALF, "merge_size": MERGE_SIZE, "patch_size": PATCH_SIZE,
        "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "size": {"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": IMAGE_MAX_PIXELS},
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    _write_json(out / "preprocessor_config.json", {**image, "processor_class": "Qwen3VLProcessor"})
    _write_json(out / "processor_config.json", {"processor_class": "Qwen3VLProcessor", "image_processor": image})


def build_tiny_qwen3_vl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen3-VL checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = qwen3_vl_config(size, vocab_size=len(tokenizer), ids=ids)

    torch.manual_seed(seed)  # the constructor's own init; every parameter is overwritten below
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed, sorted(ids.values()))
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"]
    )
    save_model(model, out)
    _write_json(out / "config.json", json.loads((out / "config.json").read_text(encoding="utf-8")))
    _write_json(out / "generation_config.json", json.loads((out / "generation_config.json").read_text()))
    _write_processor_files(out, tokenizer)
    _write_json(out / "vlmd_tiny.json", {
        "family": "qwen3_vl", "size": size, "seed": int(seed),
        "num_parameters": int(sum(p.numel() for p in model.parameters())), "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"], "image_token_id": ids["<|image_pad|>"],
        "image_min_pixels": IMAGE_MIN_PIXELS, "image_max_pixels": IMAGE_MAX_PIXELS,
    })
    return out
