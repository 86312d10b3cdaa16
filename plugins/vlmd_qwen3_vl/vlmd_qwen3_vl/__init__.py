"""Qwen3-VL, dense and mixture-of-experts: a ViT over 16-px patches with learned,
interpolated positions and 2D RoPE, a 2x2 merger and DeepStack mergers -> Qwen3 (or
Qwen3-MoE) with interleaved M-RoPE."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"),
    model="vlmd_qwen3_vl.model:Qwen3VLModel",
    processing_info="vlmd_qwen3_vl.processing:Qwen3VLProcessingInfo",
    processor="vlmd_qwen3_vl.processing:Qwen3VLProcessor",
    dummy_inputs="vlmd_qwen3_vl.processing:Qwen3VLDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["qwen3_vl"] = "vlmd_qwen3_vl.tiny:build_tiny_qwen3_vl"
    builders["qwen3_vl_moe"] = "vlmd_qwen3_vl.tiny_moe:build_tiny_qwen3_vl_moe"
