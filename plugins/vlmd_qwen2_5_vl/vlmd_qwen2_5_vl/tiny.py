"""Deterministic random Qwen2.5-VL checkpoints for tests (``Qwen2_5_VLForConditionalGeneration``).

The layout, tokenizer, chat template, weight initialisation and pixel limits are Qwen2-VL's
tiny checkpoint's (``vlmd_qwen2_vl.tiny``); the architecture is Qwen2.5-VL's:

* vision blocks with RMSNorm and a SwiGLU MLP, windowed attention in all blocks but
  ``fullatt_block_indexes``. The window is 56 px (2x2 merged tokens, 4x4 patches), so a test
  image of 8..128 tokens spans several windows and a wrong window permutation shows;
* the merger's RMSNorm (``ln_q``) projects into the text width (``out_hidden_size``);
* ``tokens_per_second`` 2: a 4 fps test video sampled to 2 fps has frame pairs 2 time
  positions apart, so a missing or wrong absolute-time scale moves the video's positions.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmd.tiny.checkpoint_io import save_model
from vlmd_qwen2_vl.tiny import (
    IMAGE_MAX_PIXELS,
    IMAGE_MIN_PIXELS,
    MERGE_SIZE,
    PATCH_SIZE,
    QWEN2_VL_CHAT_TEMPLATE,
    ROPE_THETA,
    SIZES as QWEN2_VL_SIZES,
    SPECIAL_TOKENS,
    TEMPORAL_PATCH_SIZE,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    _build_tokenizer,
    _init_weights,
    _processor_settings,
    _write_json,
)

__all__ = ["SIZES", "build_tiny_qwen2_5_vl", "qwen2_5_vl_config"]

WINDOW_SIZE = 2 * MERGE_SIZE * PATCH_SIZE  # 56 px: 2x2 merged tokens per window
TOKENS_PER_SECOND = 2

SIZES: dict[str, dict] = {
    "tiny": {
        **QWEN2_VL_SIZES["tiny"],
        # Three blocks: windowed, full, windowed.
        "vision": dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4, fullatt_block_indexes=[1]),
    },
    "small": {
        **QWEN2_VL_SIZES["small"],
        "vision": dict(depth=8, hidden_size=384, intermediate_size=1024, num_heads=6, fullatt_block_indexes=[3, 7]),
    },
}


def qwen2_5_vl_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    """The ``Qwen2_5_VLConfig`` of a ``size`` ("tiny" or "small") checkpoint."""
    from transformers import Qwen2_5_VLConfig

    spec = SIZES[size]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": spec["mrope_section"]},
            use_sliding_window=False,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            **spec["text"],
        ),
        vision_config=dict(
            out_hidden_size=spec["text"]["hidden_size"],  # the merger projects into the text width
            hidden_act="silu",
            in_channels=3,
            patch_size=PATCH_SIZE,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE,
            window_size=WINDOW_SIZE,
            tokens_per_second=TOKENS_PER_SECOND,
            **spec["vision"],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def _write_processor_files(out: Path, tokenizer) -> None:
    """Tokenizer, chat template and processor configs, as Qwen2-VL's tiny writes them but
    naming Qwen2.5-VL's processor (its image and video processors are Qwen2-VL's)."""
    tokenizer.save_pretrained(out)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["extra_special_tokens"] = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
    tok_cfg["additional_special_tokens"] = list(SPECIAL_TOKENS[1:])
    tok_cfg["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    tok_cfg["add_bos_token"] = False
    tok_cfg["add_eos_token"] = False
    _write_json(tok_cfg_path, tok_cfg)
    (out / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE, encoding="utf-8")

    image = {**_processor_settings(IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS), "image_processor_type": "Qwen2VLImageProcessor"}
    video = {**_processor_settings(VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS), "video_processor_type": "Qwen2VLVideoProcessor"}
    _write_json(out / "preprocessor_config.json", {**image, "processor_class": "Qwen2_5_VLProcessor"})
    _write_json(out / "video_preprocessor_config.json", {**video, "processor_class": "Qwen2_5_VLProcessor"})
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor", "image_processor": image})


def build_tiny_qwen2_5_vl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen2.5-VL checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = qwen2_5_vl_config(size, vocab_size=len(tokenizer), ids=ids)

    torch.manual_seed(seed)  # the constructor's own init; every parameter is overwritten below
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"]
    )
    save_model(model, out)

    # Stable bytes, and the 4.x spelling of M-RoPE (rope_scaling.type "mrope") beside 5.x's.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    rope = cfg["text_config"]["rope_parameters"]
    cfg["text_config"]["rope_theta"] = rope["rope_theta"]
    cfg["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    _write_json(cfg_path, cfg)
    _write_json(out / "generation_config.json", json.loads((out / "generation_config.json").read_text()))
    _write_processor_files(out, tokenizer)

    _write_json(
        out / "vlmd_tiny.json",
        {
            "family": "qwen2_5_vl",
            "size": size,
            "seed": int(seed),
            "num_parameters": int(num_params),
            "vocab_size": len(tokenizer),
            "eos_token_ids": eos_ids,
            "pad_token_id": ids["<|endoftext|>"],
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "image_min_pixels": IMAGE_MIN_PIXELS,
            "image_max_pixels": IMAGE_MAX_PIXELS,
            "video_min_pixels": VIDEO_MIN_PIXELS,
            "video_max_pixels": VIDEO_MAX_PIXELS,
            "window_size": WINDOW_SIZE,
            "tokens_per_second": TOKENS_PER_SECOND,
        },
    )
    return out
