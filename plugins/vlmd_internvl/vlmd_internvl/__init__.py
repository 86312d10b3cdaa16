"""InternVL3: tiles of an image (plus a thumbnail) through InternViT, pixel shuffle 0.5 and an
MLP projector into a Qwen2 language model."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="internvl",
    architectures=("InternVLForConditionalGeneration",),
    model="vlmd_internvl.model:InternVLModel",
    processing_info="vlmd_internvl.processing:InternVLProcessingInfo",
    processor="vlmd_internvl.processing:InternVLProcessor",
    dummy_inputs="vlmd_internvl.processing:InternVLDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["internvl"] = "vlmd_internvl.tiny:build_tiny_internvl"
