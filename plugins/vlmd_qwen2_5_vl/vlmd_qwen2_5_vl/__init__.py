"""Qwen2.5-VL: a windowed-attention ViT (RMSNorm, SwiGLU) and a 2x2 patch merger -> Qwen2 with
M-RoPE whose time row follows absolute video time; images and video."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model="vlmd_qwen2_5_vl.model:Qwen2_5_VLModel",
    processing_info="vlmd_qwen2_5_vl.processing:Qwen2_5_VLProcessingInfo",
    processor="vlmd_qwen2_5_vl.processing:Qwen2_5_VLProcessor",
    dummy_inputs="vlmd_qwen2_5_vl.processing:Qwen2_5_VLDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["qwen2_5_vl"] = "vlmd_qwen2_5_vl.tiny:build_tiny_qwen2_5_vl"
