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

import json
import math
from pathlib import Path

from vlmd.tiny.checkpoint_io import save_model

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


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


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


def _param_std(name: str, shape: tuple[int, ...], is_norm: bool, text_hidden: int) -> tuple[float, float]:
    """(mean, std) of the normal distribution a parameter is drawn from (see ``_init_weights``)."""
    if is_norm:
        return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.02)
    if len(shape) == 1:
        return 0.0, 0.02  # biases
    if name.startswith("lm_head"):
        return 0.0, 2.0 / math.sqrt(text_hidden)
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("embed_positions.weight"):
        return 0.0, 0.2  # below the audio's own signal, so tokens follow the sound
    fan_in = math.prod(shape[1:])
    if ".conv" in name or "multi_modal_projector" in name:
        return 0.0, 2.0 / math.sqrt(fan_in)
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.0, 1.0 / math.sqrt(fan_in)
    return 0.0, 0.5 / math.sqrt(fan_in)


def _init_weights(model, seed: int, special_ids: list[int]) -> None:
    """Overwrite every parameter from a seeded generator, in sorted-name order.

    As the Qwen2-VL builder: fan-in scaled projections (q/k at 1/sqrt(fan_in), sharp,
    position-dependent attention), unit token embeddings, norms 1 + N(0, 0.1) and biases
    N(0, 0.02) so a loader that drops either is caught, ``lm_head`` at 2/sqrt(hidden) so greedy
    top-1/top-2 gaps sit far above float32 noise; the convolutions and the projector at
    2/sqrt(fan_in) so audio vectors are on the scale of token embeddings and answers depend
    on the clip. The ``lm_head`` rows of special tokens are zeroed (greedy emits ordinary text).
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    norm_names: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
            norm_names.update(f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False))
    text_hidden = model.config.text_config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            mean, std = _param_std(name, tuple(param.shape), name in norm_names, text_hidden)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std + mean)
        model.get_output_embeddings().weight[special_ids] = 0.0


def _write_processor_files(out: Path, tokenizer) -> None:
    tokenizer.save_pretrained(out)
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.x writes a name 4.x does not know
    tok_cfg.pop("extra_special_tokens", None)
    tok_cfg["additional_special_tokens"] = list(SPECIAL_TOKENS[1:])
    tok_cfg["chat_template"] = QWEN2_AUDIO_CHAT_TEMPLATE
    tok_cfg["add_bos_token"] = False
    tok_cfg["add_eos_token"] = False
    _write_json(tok_cfg_path, tok_cfg)
    (out / "chat_template.jinja").write_text(QWEN2_AUDIO_CHAT_TEMPLATE, encoding="utf-8")
    _write_json(out / "preprocessor_config.json", {**FEATURE_EXTRACTOR, "processor_class": "Qwen2AudioProcessor"})
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2AudioProcessor",
                                                "feature_extractor": dict(FEATURE_EXTRACTOR)})


def build_tiny_qwen2_audio(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random Qwen2-Audio checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    import torch
    from transformers import GenerationConfig, Qwen2AudioForConditionalGeneration

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(seed, spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    ids = {token: vocab[token] for token in SPECIAL_TOKENS}
    config = qwen2_audio_config(size, vocab_size=len(tokenizer), ids=ids)

    torch.manual_seed(seed)  # the constructor's own init; every parameter is overwritten below
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32).eval()
    _init_weights(model, seed, sorted(ids.values()))
    num_params = sum(p.numel() for p in model.parameters())
    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=eos_ids, pad_token_id=ids["<|endoftext|>"]
    )
    save_model(model, out)
    for name in ("config.json", "generation_config.json"):  # stable bytes
        _write_json(out / name, json.loads((out / name).read_text(encoding="utf-8")))
    _write_processor_files(out, tokenizer)
    _write_json(
        out / "vlmd_tiny.json",
        {
            "family": "qwen2_audio", "size": size, "seed": int(seed), "num_parameters": int(num_params),
            "vocab_size": len(tokenizer), "eos_token_ids": eos_ids, "pad_token_id": ids["<|endoftext|>"],
            "audio_token_id": ids["<|AUDIO|>"], "audio_bos_token_id": ids["<|audio_bos|>"],
            "audio_eos_token_id": ids["<|audio_eos|>"],
        },
    )
    return out
