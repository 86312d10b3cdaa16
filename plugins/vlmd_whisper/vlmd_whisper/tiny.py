"""Deterministic random Whisper checkpoints for tests (``WhisperForConditionalGeneration``).

Layout written to ``out_dir`` (byte-identical for the same seed and size):

* ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, transformers names)
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
* ``preprocessor_config.json`` (``WhisperFeatureExtractor``: 80 mel bins, 16 kHz, 30 s windows)
* ``vlmd_tiny.json``: what was built (family, size, seed, parameter count, special token ids)

The checkpoint is *multilingual* like ``openai/whisper-tiny``: after a locally trained byte-level
BPE vocabulary come ``<|endoftext|>``, ``<|startoftranscript|>``, 99 language tokens in
OpenAI's order, the task and control tokens, then 1,501 timestamps ``<|0.00|>`` .. ``<|30.00|>``
(all special). The generation config carries ``lang_to_id``/``task_to_id``, so transformers
detects languages and translates with it. The real ``tiny.en`` (English-only) comes from
``vlmd convert --from ct2``. ``max_target_positions`` is small so random decodes stay short.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from vlmd.tiny.checkpoint_io import restamp_json, save_model, write_json
from vlmd.tiny.weights import random_model

__all__ = ["SIZES", "build_tiny_whisper", "special_token_names"]

NUM_LANGUAGES = 99  # openai/whisper-tiny .. large-v2 (large-v3 adds <|yue|>)
NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 0.02 s steps
CONTROL_TOKENS = ("<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>")

SIZES: dict[str, dict] = {
    "tiny": dict(
        base_vocab=1024, d_model=64, encoder_layers=2, decoder_layers=2, heads=4, ffn=128, max_target_positions=64
    ),
    "small": dict(
        base_vocab=8192, d_model=384, encoder_layers=4, decoder_layers=4, heads=6, ffn=1536, max_target_positions=448
    ),
}


def special_token_names() -> list[str]:
    """Every token after the trained vocabulary, in id order (as in OpenAI's multilingual vocab)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    languages = [f"<|{code}|>" for code in list(LANGUAGES)[:NUM_LANGUAGES]]
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(NUM_TIMESTAMPS)]
    return ["<|endoftext|>", "<|startoftranscript|>", *languages, *CONTROL_TOKENS, *timestamps]


def _param_std(name: str, shape: tuple[int, ...], is_norm: bool) -> tuple[float, float] | None:
    """(mean, std) of a parameter's draw (``vlmd.tiny.weights``: one seeded generator, in
    sorted-name order), chosen so that a random decoder's tokens depend on the audio and on
    position, and greedy top-1/top-2 gaps sit far above float32 noise:
    - conv weights at 2/sqrt(fan_in): the encoder output follows the mel features rather
      than the sinusoidal positions (kept as built: None);
    - cross-attention q/k at 3/sqrt(fan_in): peaked, content-dependent attention, so the
      tokens depend on the audio; its output at 0.5/sqrt(fan_in), or one audio-driven
      direction would pick the same token at every position;
    - decoder positions at 2.0 and decoder self-attention q/k at 2/sqrt(fan_in): position
      and history move the choice (a position bug changes tokens);
    - the final decoder norm's weight at 6 +- 0.6: logits std ~10, so greedy top-1/top-2
      gaps sit far above float32 noise;
    - token embeddings at 0.2 (tied to the output layer): with unit-std embeddings a
      token's own embedding dominates the residual stream and the model repeats its
      last token forever (timestamp rows scaled down after the draw, see ``_TIMESTAMP_SCALE``);
    - other projections at 0.5/sqrt(fan_in) (encoder q/k at 1/sqrt(fan_in)), layer norms at
      1 + N(0, 0.1), biases at N(0, 0.02), so a loader that drops a norm or a bias is caught.
    """
    if name.endswith("encoder.embed_positions.weight"):
        return None
    if name == "model.decoder.layer_norm.weight":
        return 6.0, 0.6  # the logit scale (see above)
    if is_norm:
        return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.02)
    if len(shape) == 1:
        return 0.0, 0.02
    if name.endswith("embed_tokens.weight"):
        return 0.0, 0.2
    if name.endswith("decoder.embed_positions.weight"):
        return 0.0, 2.0
    return 0.0, _projection_gain(name) / math.sqrt(math.prod(shape[1:]))


# Timestamp rows of the (tied) token embeddings at 0.4 x 0.2 = 0.08: 1,501 of them with
# full-size logits would crowd text out of every greedy decode.
_TIMESTAMP_SCALE = 0.4


def _projection_gain(name: str) -> float:
    query_or_key = name.endswith(("q_proj.weight", "k_proj.weight"))
    if ".conv" in name:
        return 2.0
    if "encoder_attn." in name:
        return 3.0 if query_or_key else 0.5
    if "decoder." in name and query_or_key:
        return 2.0
    return 1.0 if query_or_key else 0.5


def _tokenizer_files(out: Path, tokenizer, eot: str) -> None:
    """Save the tokenizer as transformers' ``WhisperTokenizer`` reads it (4.x and 5.x)."""
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(
        tokenizer_class="WhisperTokenizer", bos_token=eot, eos_token=eot, unk_token=eot, pad_token=eot,
        add_prefix_space=False, add_bos_token=False, add_eos_token=False, model_max_length=1024,
        clean_up_tokenization_spaces=False, errors="replace",
    )
    config.pop("extra_special_tokens", None)
    # Listed so transformers counts the control tokens in all_special_ids, as in OpenAI's
    # configs (the timestamps are special to the tokenizer, but not listed).
    config["additional_special_tokens"] = [t for t in special_token_names() if t != eot and not t[2].isdigit()]
    write_json(config_path, config)
    write_json(out / "special_tokens_map.json", {"bos_token": eot, "eos_token": eot, "unk_token": eot, "pad_token": eot})


def whisper_generation_config(vocab: dict[str, int], suppress: list[int], max_length: int) -> dict:
    """The generation settings transformers' Whisper ``generate`` reads (multilingual)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    eot, sot = vocab["<|endoftext|>"], vocab["<|startoftranscript|>"]
    lang_to_id = {f"<|{code}|>": vocab[f"<|{code}|>"] for code in list(LANGUAGES)[:NUM_LANGUAGES]}
    return {
        "decoder_start_token_id": sot,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "is_multilingual": True,
        "lang_to_id": lang_to_id,
        "task_to_id": {"transcribe": vocab["<|transcribe|>"], "translate": vocab["<|translate|>"]},
        "no_timestamps_token_id": vocab["<|notimestamps|>"],
        "prev_sot_token_id": vocab["<|startofprev|>"],
        "max_initial_timestamp_index": 50,
        "suppress_tokens": suppress,
        "begin_suppress_tokens": [vocab["Ġ"], eot],
        "max_length": max_length,
    }


def build_tiny_whisper(out_dir, seed: int = 0, size: str = "tiny") -> Path:
    """Build a random multilingual Whisper checkpoint into ``out_dir`` and return its path."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from vlmd.tiny.tokenizer_builder import build_bpe_tokenizer

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = special_token_names()
    tokenizer = build_bpe_tokenizer(
        seed=seed, vocab_size=spec["base_vocab"] + len(specials), trailing_special_tokens=specials,
        unk_token="<|endoftext|>",
    )
    vocab = tokenizer.get_vocab()
    eot, sot = vocab["<|endoftext|>"], vocab["<|startoftranscript|>"]
    # Like OpenAI's list: some ordinary tokens (chosen by seed) plus the control tokens that
    # must never be generated.
    rng = random.Random(f"vlmd-tiny-whisper-suppress-{seed}")
    ordinary = sorted(rng.sample(range(300, spec["base_vocab"] - 1), 24))
    controls = [sot] + [vocab[t] for t in CONTROL_TOKENS[:-1]]
    suppress = ordinary + controls
    generation = whisper_generation_config(vocab, suppress, spec["max_target_positions"])
    # Word timestamps need alignment heads: openai-whisper's default where a checkpoint names
    # none, every head of the second half of the decoder's layers.
    layers = spec["decoder_layers"]
    generation["alignment_heads"] = [[layer, head] for layer in range(layers // 2, layers) for head in range(spec["heads"])]

    config = WhisperConfig(
        vocab_size=len(tokenizer), num_mel_bins=80, d_model=spec["d_model"],
        encoder_layers=spec["encoder_layers"], decoder_layers=spec["decoder_layers"],
        encoder_attention_heads=spec["heads"], decoder_attention_heads=spec["heads"],
        encoder_ffn_dim=spec["ffn"], decoder_ffn_dim=spec["ffn"], activation_function="gelu",
        max_source_positions=1500, max_target_positions=spec["max_target_positions"],
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot, decoder_start_token_id=sot,
        suppress_tokens=suppress, begin_suppress_tokens=generation["begin_suppress_tokens"],
        scale_embedding=False, tie_word_embeddings=True,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    # Every parameter but the encoder's sinusoidal positions is drawn. No output row is zeroed:
    # the output layer is the token embeddings, so that would zero the specials' inputs too.
    model = random_model(WhisperForConditionalGeneration, config, seed, _param_std)
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab["<|0.00|>"]:] *= _TIMESTAMP_SCALE
    n_params = sum(p.numel() for p in model.parameters())
    save_model(model, out)
    write_json(out / "generation_config.json", generation)
    restamp_json(out, "config.json")

    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)
    features = extractor.to_dict()
    features.pop("mel_filters", None)  # derived from the other settings
    features["processor_class"] = "WhisperProcessor"
    write_json(out / "preprocessor_config.json", features)
    _tokenizer_files(out, tokenizer, "<|endoftext|>")

    write_json(
        out / "vlmd_tiny.json",
        {
            "family": "whisper", "size": size, "seed": int(seed), "num_parameters": int(n_params),
            "vocab_size": len(tokenizer), "eos_token_id": eot, "decoder_start_token_id": sot,
            "no_timestamps_token_id": vocab["<|notimestamps|>"], "timestamp_begin": vocab["<|0.00|>"],
        },
    )
    return out
