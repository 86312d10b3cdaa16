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
