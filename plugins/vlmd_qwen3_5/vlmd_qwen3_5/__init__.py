"""Qwen3.5, dense and mixture-of-experts: Qwen3-VL's vision tower without DeepStack -> a hybrid decoder of Gated DeltaNet
(linear attention, a recurrent state per request) and gated full-attention layers with
partial, interleaved M-RoPE."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    model="vlmd_qwen3_5.model:Qwen3_5Model",
    processing_info="vlmd_qwen3_5.processing:Qwen3_5ProcessingInfo",
    processor="vlmd_qwen3_vl.processing:Qwen3VLProcessor",
    dummy_inputs="vlmd_qwen3_vl.processing:Qwen3VLDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["qwen3_5"] = "vlmd_qwen3_5.tiny:build_tiny_qwen3_5"
    builders["qwen3_5_moe"] = "vlmd_qwen3_5.tiny_moe:build_tiny_qwen3_5_moe"
