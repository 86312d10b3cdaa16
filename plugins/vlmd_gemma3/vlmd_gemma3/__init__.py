"""Gemma 3: SigLIP tower, 4x4 average pooling and a projector -> a Gemma decoder whose local
layers attend through a sliding window and whose image tokens attend to each other both ways."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    model="vlmd_gemma3.model:Gemma3Model",
    processing_info="vlmd_gemma3.processing:Gemma3ProcessingInfo",
    processor="vlmd_gemma3.processing:Gemma3Processor",
    dummy_inputs="vlmd_gemma3.processing:Gemma3DummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["gemma3"] = "vlmd_gemma3.tiny:build_tiny_gemma3"
