"""Deterministic random LLaVA-1.5 checkpoints for tests (``LlavaForConditionalGeneration``).

Layout written to ``out_dir`` (all byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers 5 names)
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``
* ``processor_config.json`` (transformers 5) and ``preprocessor_config.json`` (transformers 4.x)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

Architecture as LLaVA-1.5: CLIP ViT vision tower (336 px, patch 14 -> 576 patches + CLS), features
from ``vision_feature_layer=-2`` with the CLS dropped (576 image tokens), a 2-layer GELU MLP
projector and a Llama text model, here with GQA and ``rope_theta=500000``.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmd.tiny.checkpoint_io import finish_tokenizer_config, restamp_json, save_model, write_json
from vlmd.tiny.weights import StdRule, random_model

__all__ = ["SIZES", "build_tiny_llava", "LLAVA_CHAT_TEMPLATE"]

IMAGE_SIZE = 336
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 576 (CLS dropped by the "default" strategy)

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Ids 0-2 as in Llama vocabularies; <image> and <pad> after the trained vocabulary as in
# llava-hf/llava-1.5-7b-hf (<image>=32000, <pad>=32001 there).
LEADING_SPECIALS = ("<unk>", "<s>", "</s>")
TRAILING_SPECIALS = ("<image>", "<pad>")

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "vision": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4),
        "text": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048),
    },
    "small": {
        "vocab_size": 8192,
        "vision": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8),
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
                     num_key_value_heads=4, max_position_embeddings=4096),
    },
}

ROPE_THETA = 500000.0

# LLaVA-1.5 ("llava_v1") conversation format, for OpenAI-like messages whose content is either a
# string or a list of parts {"type": "text", "text": ...} / {"type": "image"} (or "image_url").
#
#   <s>[system text ]USER: <image>\n...<image>\n<text parts joined by " "> ASSISTANT: <reply></s>USER: ... ASSISTANT:
#
# Images of a message come first, each as "<image>\n", then its text, as in LLaVA-1.5 and in the
# template of llava-hf checkpoints.  The template writes bos itself ({{ bos_token }}) and the
# tokenizer never adds one (its post-processor adds no special tokens; add_bos_token=false), so the
# rendered text has to be tokenized as is: with add_special_tokens=False (or True: same ids).
LLAVA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set ns = namespace(images=0, texts=[message['content']]) -%}"
    "{%- else -%}"
    "{%- set ns = namespace(images=0, texts=[]) -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{%- set ns.images = ns.images + 1 -%}"
    "{%- elif part['type'] in ('text', 'input_text') -%}"
    "{%- set ns.texts = ns.texts + [part['text']] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- set text = ns.texts | join(' ') -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- text + ' ' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'ASSISTANT: ' + text + eos_token -}}"
    "{%- else -%}"
    "{{- 'USER: ' + '<image>\\n' * ns.images + text + ' ' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- 'ASSISTANT:' -}}"
    "{%- endif -%}"
)

# Words mixed into the tokenizer corpus so that template keywords are compact tokens.
_EXTRA_WORDS = ("USER:", "ASSISTANT:", "USER", "ASSISTANT", "What", "Describe", "image")

# vlmd.tiny.weights' rule; CLIP's class and position embeddings at 0.5, its patch embedding
# sharp like q/k.
PARAM_STD = StdRule(fixed=[(("class_embedding", "position_embedding.weight"), 0.0, 0.5)],
                    gains=[(("patch_embedding.weight",), 1.0)])


def _build_tokenizer(seed: int, vocab_size: int):
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, leading_special_tokens=LEADING_SPECIALS,
        trailing_special_tokens=TRAILING_SPECIALS, unk_token="<unk>", extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(
            bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_special_tokens=["<image>"],
            model_max_length=4096, padding_side="left", clean_up_tokenization_spaces=False,
            chat_template=LLAVA_CHAT_TEMPLATE,
        ),
    )


def _normalize_json_files(out: Path) -> None:
    """Rewrite the json files the processor saved with sorted keys (stable bytes) and add the
    4.x special-token keys. No automatic bos: the chat template writes it (LLAVA_CHAT_TEMPLATE)."""
    tok_cfg = finish_tokenizer_config(out, LLAVA_CHAT_TEMPLATE, extra_special_tokens={"image_token": "<image>"},
                                      additional_special_tokens=["<image>"])

    stm_path = out / "special_tokens_map.json"
    if stm_path.exists():
        stm = json.loads(stm_path.read_text(encoding="utf-8"))
    else:
        stm = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if tok_cfg.get(key) is not None:
            stm.setdefault(key, tok_cfg[key])
    stm["additional_special_tokens"] = list(TRAILING_SPECIALS[:1])
    write_json(stm_path, stm)

    # transformers 5 keeps rope_theta inside rope_parameters; transformers 4.x (and other
    # loaders) read text_config.rope_theta and would silently fall back to 10000.  Write both.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    rope = cfg["text_config"].get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg["text_config"]["rope_theta"] = rope["rope_theta"]
    write_json(cfg_path, cfg)
    restamp_json(out, "generation_config.json", "processor_config.json")


def llava_config(size: str, *, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, image_id: int):
    """The ``LlavaConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    spec = SIZES[size]
    vision_config = CLIPVisionConfig(
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, num_channels=3, hidden_act="quick_gelu", layer_norm_eps=1e-5,
        projection_dim=spec["vision"]["hidden_size"], **spec["vision"],
    )
    text_config = LlamaConfig(
        vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, **spec["text"],
    )
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=image_id,
        image_seq_length=NUM_IMAGE_TOKENS, projector_hidden_act="gelu", vision_feature_select_strategy="default",
        vision_feature_layer=-2, multimodal_projector_bias=True, tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def count_parameters(size: str, vocab_size: int | None = None) -> int:
    """Parameter count of a ``size`` checkpoint, computed on the meta device (no memory, ~instant)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    vocab_size = SIZES[size]["vocab_size"] if vocab_size is None else vocab_size
    config = llava_config(size, vocab_size=vocab_size, bos_id=1, eos_id=2, pad_id=vocab_size - 1, image_id=vocab_size - 2)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def build_tiny_llava(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random LLaVA-1.5 checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import CLIPImageProcessorPil, GenerationConfig, LlavaForConditionalGeneration, LlavaProcessor

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {t: vocab[t] for t in LEADING_SPECIALS + TRAILING_SPECIALS}
    bos_id, eos_id, pad_id, image_id = ids["<s>"], ids["</s>"], ids["<pad>"], ids["<image>"]

    config = llava_config(
        size, vocab_size=len(tokenizer), bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, image_id=image_id
    )

    model = random_model(LlavaForConditionalGeneration, config, seed, PARAM_STD, sorted(ids.values()))
    n_params = sum(p.numel() for p in model.parameters())

    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)

    save_model(model, out)

    image_processor = CLIPImageProcessorPil(
        do_resize=True, size={"shortest_edge": IMAGE_SIZE}, resample=3,  # PIL bicubic
        do_center_crop=True, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_rescale=True,
        rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, image_token="<image>",
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    # transformers 4.x reads the image processor from preprocessor_config.json.
    ip_dict = image_processor.to_dict()
    ip_dict["processor_class"] = "LlavaProcessor"
    write_json(out / "preprocessor_config.json", ip_dict)
    _normalize_json_files(out)

    write_json(
        out / "vlmd_tiny.json",
        {
            "family": "llava", "size": size, "seed": int(seed), "num_parameters": int(n_params),
            "vocab_size": len(tokenizer), "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
            "unk_token_id": ids["<unk>"], "image_token_id": image_id, "num_image_tokens": NUM_IMAGE_TOKENS,
        },
    )
    return out
