"""Gemma 4: a decoder whose last layers reuse earlier layers' K/V, with per-layer embeddings,
windowed layers between full-attention ones of wider heads and proportional RoPE; images
through its vision tower at a per-request token budget; video as timestamped frames through the
same tower (``video.py``); audio clips (E2B / E4B) through its conformer audio tower
(``audio.py``), in chat and at /v1/audio/transcriptions."""

from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.registry import ModelFamily

FAMILY = ModelFamily(
    name="gemma4",
    architectures=("Gemma4ForConditionalGeneration",),
    model="vlmd_gemma4.model:Gemma4Model",
    processing_info="vlmd_gemma4.audio_processing:Gemma4AudioProcessingInfo",
    processor="vlmd_gemma4.audio_processing:gemma4_processor",
    dummy_inputs="vlmd_gemma4.audio_processing:Gemma4AudioDummyInputsBuilder",
)


@hookimpl
def vlmd_register_model_families(registry):
    registry.register(FAMILY)


@hookimpl
def vlmd_register_tiny_builders(builders):
    builders["gemma4"] = "vlmd_gemma4.tiny:build_tiny_gemma4"
    builders["gemma4_moe"] = "vlmd_gemma4.tiny:build_tiny_gemma4_moe"
    builders["gemma4_audio"] = "vlmd_gemma4.tiny:build_tiny_gemma4_audio"
