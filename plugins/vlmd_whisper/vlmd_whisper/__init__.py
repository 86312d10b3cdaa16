"""Whisper: log-mel encoder, decoder with cross-attention; /v1/audio/transcriptions and translations."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="whisper",
    architectures=("WhisperForConditionalGeneration",),
    model="vlmd_whisper.model:WhisperModel",
    processing_info="vlmd_whisper.processing:WhisperProcessingInfo",
    processor="vlmd_whisper.processing:WhisperAudioProcessor",
    dummy_inputs="vlmd_whisper.processing:WhisperDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["whisper"] = "vlmd_whisper.tiny:build_tiny_whisper"


@hookimpl
def vlmd_register_converters(converters):
    converters["ct2"] = "vlmd_whisper.convert.ct2_whisper:convert_ct2_whisper"
