"""Llama 3.2 Vision: image tiles through a two-stage vision tower, and a Llama 3 decoder whose
cross-attention layers attend to them (the image never enters the self-attention)."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="mllama",
    architectures=("MllamaForConditionalGeneration",),
    model="vlmd_mllama.model:MllamaModel",
    processing_info="vlmd_mllama.processing:MllamaProcessingInfo",
    processor="vlmd_mllama.processing:MllamaProcessor",
    dummy_inputs="vlmd_mllama.processing:MllamaDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["mllama"] = "vlmd_mllama.tiny:build_tiny_mllama"
