"""Qwen2-Audio: Whisper-style audio encoder + 2x average pooling -> linear projector -> Qwen2.

Audio clips (up to 30 s) in chat (``input_audio`` / ``audio_url`` parts) and
/v1/audio/transcriptions through a transcription prompt.
"""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen2_audio",
    architectures=("Qwen2AudioForConditionalGeneration",),
    model="vlmd_qwen2_audio.model:Qwen2AudioModel",
    processing_info="vlmd_qwen2_audio.processing:Qwen2AudioProcessingInfo",
    processor="vlmd_qwen2_audio.processing:Qwen2AudioProcessor",
    dummy_inputs="vlmd_qwen2_audio.processing:Qwen2AudioDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["qwen2_audio"] = "vlmd_qwen2_audio.tiny:build_tiny_qwen2_audio"
