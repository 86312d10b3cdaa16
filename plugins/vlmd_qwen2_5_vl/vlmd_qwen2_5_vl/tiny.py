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

from pathlib import Path

from vlmd_qwen2_vl.tiny import (
    MERGE_SIZE,
    PATCH_SIZE,
    ROPE_THETA,
    SIZES as QWEN2_VL_SIZES,
    TEMPORAL_PATCH_SIZE,
    build_qwen_vl_checkpoint,
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


def build_tiny_qwen2_5_vl(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen2.5-VL checkpoint into ``out_dir`` and return its path."""
    return build_qwen_vl_checkpoint(
        out_dir, seed, size, family="qwen2_5_vl", sizes=SIZES, make_config=qwen2_5_vl_config,
        model_class="Qwen2_5_VLForConditionalGeneration", processor_class="Qwen2_5_VLProcessor",
        summary={"window_size": WINDOW_SIZE, "tokens_per_second": TOKENS_PER_SECOND},
    )
