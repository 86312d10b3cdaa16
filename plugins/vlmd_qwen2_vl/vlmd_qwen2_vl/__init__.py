"""Qwen2-VL: ViT with 2D RoPE and a 2x2 patch merger -> Qwen2 with M-RoPE; images and video."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen2_vl",
    architectures=("Qwen2VLForConditionalGeneration",),
    model="vlmd_qwen2_vl.model:Qwen2VLModel",
    processing_info="vlmd_qwen2_vl.processing:Qwen2VLProcessingInfo",
    processor="vlmd_qwen2_vl.processing:Qwen2VLProcessor",
    dummy_inputs="vlmd_qwen2_vl.processing:Qwen2VLDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["qwen2_vl"] = "vlmd_qwen2_vl.tiny:build_tiny_qwen2_vl"
