"""LLaVA-1.5: CLIP ViT (feature layer -2, CLS dropped) -> 2-layer MLP -> Llama."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    model="vlmd_llava.model:LlavaModel",
    processing_info="vlmd_llava.processing:LlavaProcessingInfo",
    processor="vlmd_llava.processing:LlavaProcessor",
    dummy_inputs="vlmd_llava.processing:LlavaDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["llava"] = "vlmd_llava.tiny:build_tiny_llava"
