"""Deterministic random Qwen2-Audio checkpoints for tests (``Qwen2AudioForConditionalGeneration``).

Layout written to ``out_dir`` (byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers names)
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``
* ``preprocessor_config.json`` (``WhisperFeatureExtractor``: 128 mel bins, 16 kHz, 30 s) and
  ``processor_config.json`` (transformers 5's processor layout)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

Architecture as Qwen2-Audio: a Whisper-style encoder (two convolutions, the second with stride
2, over 3,000 log-mel frames; 1,500 learned positions; pre-norm layers) whose output is average
pooled by 2 (750 vectors per 30 s), a linear projector into the text width, and a Qwen2 text
model (q/k/v bias, GQA). The vocabulary ends with Qwen2's ``<|endoftext|> <|im_start|>
<|im_end|>`` and Qwen2-Audio's ``<|AUDIO|> <|audio_bos|> <|audio_eos|>``, in that order.
"""

from __future__ import annotations

from pathlib import Path

from vlmd.tiny.checkpoint_io import save_checkpoint, write_json, write_tokenizer
from vlmd.tiny.weights import StdRule, random_model

__all__ = ["SIZES", "QWEN2_AUDIO_CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_qwen2_audio"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")

SIZES: dict[str, dict] = {
    "tiny": {
        "vocab_size": 4096,
        "audio": dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128),
        "text": dict(
            hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096,
        ),
    },
    "small": {
        "vocab_size": 8192,
        "audio": dict(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536),
        "text": dict(
            hidden_size=768, intermediate_size=2048, num_hidden_layers=9, num_attention_heads=12,
            num_key_value_heads=4, max_position_embeddings=8192,
        ),
    },
}

# Low, like the Qwen2-VL builder's: over test-length prompts every rotary frequency turns, so a
# position bug changes tokens.
ROPE_THETA = 100.0

# The chat template of Qwen/Qwen2-Audio-7B-Instruct, verbatim.
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content %}{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen/Qwen2-Audio-7B-Instruct's preprocessor_config.json.
FEATURE_EXTRACTOR = {
    "chunk_length": 30,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
}

_EXTRA_WORDS = ("system", "user", "assistant", "Audio", "You", "are", "helpful", "Transcribe", "What", "sound")

# vlmd.tiny.weights' rule; the encoder's positions below the audio's own signal, so tokens
# follow the sound; the convolutions and the projector at 2/sqrt(fan_in), so audio vectors are
# on the scale of token embeddings and answers depend on the clip.
PARAM_STD = StdRule(fixed=[(("embed_positions.weight",), 0.0, 0.2)],
                    gains=[((".conv", "multi_modal_projector"), 2.0)])


def _build_tokenizer(seed: int, vocab_size: int):
    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    return build_bpe_tokenizer(
        seed=seed, vocab_size=vocab_size, trailing_special_tokens=SPECIAL_TOKENS, extra_words=_EXTRA_WORDS,
        tokenizer_kwargs=dict(
            eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768,
            clean_up_tokenization_spaces=False, chat_template=QWEN2_AUDIO_CHAT_TEMPLATE,
        ),
    )


def qwen2_audio_config(size: str, *, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2AudioConfig

    spec = SIZES[size]
    config = Qwen2AudioConfig(
        audio_config=dict(
            num_mel_bins=FEATURE_EXTRACTOR["feature_size"], max_source_positions=1500, activation_function="gelu",
            **spec["audio"],
        ),
        text_config=dict(
            vocab_size=vocab_size, hidden_act="silu", rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, use_sliding_window=False,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            tie_word_embeddings=False, **spec["text"],
        ),
        audio_token_index=ids["<|AUDIO|>"],
    )
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    return config


def _write_processor_files(out: Path, tokenizer) -> None:
    write_tokenizer(out, tokenizer, QWEN2_AUDIO_CHAT_TEMPLATE, extra_special_tokens=None,
                    additional_special_tokens=SPECIAL_TOKENS[1:])
    write_json(out / "preprocessor_config.json", {**FEATURE_EXTRACTOR, "processor_class": "Qwen2AudioProcessor"})
    write_json(out / "processor_config.json", {"processor_class": "Qwen2AudioProcessor",
                                                "feature_extractor": dict(FEATURE_EXTRACTOR)})


def build_tiny_qwen2_audio(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen2-Audio checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    from transformers import Qwen2AudioForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = qwen2_audio_config(size, vocab_size=len(tokenizer), ids=ids)

    model = random_model(Qwen2AudioForConditionalGeneration, config, seed, PARAM_STD, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    save_checkpoint(model, out, ids["<|endoftext|>"], eos_ids, ids["<|endoftext|>"])
    _write_processor_files(out, tokenizer)
    write_json(
        out / "vlmd_tiny.json",
        {
            "family": "qwen2_audio", "size": size, "seed": int(seed), "num_parameters": int(num_params),
            "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"],
            "audio_token_id": ids["<|AUDIO|>"], "audio_bos_token_id": ids["<|audio_bos|>"],
            "audio_eos_token_id": ids["<|audio_eos|>"],
        },
    )
    return out
