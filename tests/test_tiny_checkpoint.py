"""Tests for the deterministic tiny checkpoint builders (vlmd.testing.tiny*) and tests/oracle.py."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle  # noqa: E402
from vlmd.testing.tiny import build_tiny, builders  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]

EXPECTED_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vlmd_tiny.json",
}


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny("llava", tmp_path_factory.mktemp("tiny_llava_seed0"), seed=0, size="tiny")


@pytest.fixture(scope="module")
def summary(tiny_dir) -> dict:
    return json.loads((tiny_dir / "vlmd_tiny.json").read_text())


@pytest.fixture(scope="module")
def image_640x480():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1234)
    return Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), mode="RGB")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


# --------------------------------------------------------------------------- determinism


def test_files_written(tiny_dir):
    assert {p.name for p in tiny_dir.iterdir()} == EXPECTED_FILES


def test_same_seed_is_byte_identical_across_processes(tiny_dir, tmp_path):
    """Second build through the CLI, in another process with another hash seed and thread count."""
    out = tmp_path / "again"
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="2", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vlmd.testing.tiny", "--family", "llava", "--out", str(out), "--seed", "0"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "parameters" in proc.stdout and str(out) in proc.stdout, proc.stdout
    a, b = _hashes(tiny_dir), _hashes(out)
    assert set(a) == EXPECTED_FILES
    differing = sorted(name for name in a if a[name] != b.get(name))
    assert a == b, f"files differ between two builds with the same seed: {differing}"


def test_different_seed_gives_different_weights(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    other = build_tiny("llava", tmp_path / "seed1", seed=1)
    w0 = load_file(tiny_dir / "model.safetensors")
    w1 = load_file(other / "model.safetensors")
    assert w0.keys() == w1.keys()
    same = [k for k in w0 if w0[k].shape == w1[k].shape and bool((w0[k] == w1[k]).all())]
    assert not same, f"tensors identical across seeds: {same}"
    # The special token ids do not depend on the seed.
    s0 = json.loads((tiny_dir / "vlmd_tiny.json").read_text())
    s1 = json.loads((other / "vlmd_tiny.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "num_parameters"):
        assert s0[key] == s1[key], key


# --------------------------------------------------------------------------- config & weights


def test_config_matches_llava_15(tiny_dir, summary):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["model_type"] == "llava"
    assert cfg["vision_feature_layer"] == -2
    assert cfg["vision_feature_select_strategy"] == "default"
    assert cfg["projector_hidden_act"] == "gelu"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["image_token_index"] == summary["image_token_id"]
    v, t = cfg["vision_config"], cfg["text_config"]
    assert (v["image_size"], v["patch_size"]) == (336, 14)
    assert t["num_key_value_heads"] < t["num_attention_heads"]
    assert t["rope_parameters"]["rope_theta"] == t["rope_theta"] == 500000.0
    assert t["tie_word_embeddings"] is False
    assert t["vocab_size"] == summary["vocab_size"]
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        summary["bos_token_id"],
        summary["eos_token_id"],
        summary["pad_token_id"],
    )
    assert (t["bos_token_id"], t["eos_token_id"], t["pad_token_id"]) == (
        summary["bos_token_id"],
        summary["eos_token_id"],
        summary["pad_token_id"],
    )


def test_weights_float32_and_special_rows_zeroed(tiny_dir, summary):
    import torch
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in keys)
        lm_head = f.get_tensor("language_model.lm_head.weight")
        embed = f.get_tensor("language_model.model.embed_tokens.weight")
    assert "vision_tower.embeddings.patch_embedding.weight" in keys
    assert "multi_modal_projector.linear_2.bias" in keys
    special = [summary[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "image_token_id")]
    assert torch.all(lm_head[special] == 0)
    ordinary = torch.ones(lm_head.shape[0], dtype=torch.bool)
    ordinary[special] = False
    assert bool((lm_head[ordinary].abs().sum(-1) > 0).all())
    assert not torch.equal(lm_head, embed)  # untied


def test_small_size_is_about_100m_parameters():
    from vlmd_llava.tiny import SIZES, count_parameters

    n = count_parameters("small")
    assert 80_000_000 <= n <= 120_000_000, n
    assert SIZES["small"]["text"]["num_key_value_heads"] < SIZES["small"]["text"]["num_attention_heads"]


# --------------------------------------------------------------------------- transformers loading


def test_transformers_loads_offline_without_key_warnings(tiny_dir):
    import torch
    import transformers
    from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

    handler = _Records()
    transformers.logging.add_handler(handler)
    try:
        model, info = LlavaForConditionalGeneration.from_pretrained(
            tiny_dir, output_loading_info=True, dtype=torch.float32
        )
        AutoTokenizer.from_pretrained(tiny_dir)
        processor = AutoProcessor.from_pretrained(tiny_dir)
    finally:
        transformers.logging.remove_handler(handler)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    messages = [r.getMessage() for r in handler.records]
    assert not [m for m in messages if "missing" in m.lower() or "unexpected" in m.lower() or "newly" in m.lower()]
    assert type(processor).__name__ == "LlavaProcessor"
    assert processor.image_processor.backend == "pil"  # no torchvision here
    assert model.config.text_config.rope_parameters["rope_theta"] == 500000.0


def test_processor_expands_image_into_576_tokens(tiny_dir, summary, image_640x480):
    _, processor = oracle.load_hf_llava(tiny_dir)
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s>USER: <image>\nWhat is this? ASSISTANT:"
    inputs = processor(text=prompt, images=[image_640x480], return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(summary["image_token_id"]) == 576
    assert ids[0] == summary["bos_token_id"] and ids.count(summary["bos_token_id"]) == 1
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 336, 336)
    # The tokenizer never adds bos by itself: same ids with or without add_special_tokens.
    tok = processor.tokenizer
    assert tok(prompt, add_special_tokens=True).input_ids == tok(prompt, add_special_tokens=False).input_ids


def test_tokenizer_json_matches_hf_tokenizer(tiny_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    text = "<s>A chat. USER: <image>\nDescribe the image, please!\tThanks 42 ASSISTANT: ok</s>USER: more? ASSISTANT:"
    assert raw.encode(text).ids == hf(text, add_special_tokens=False).input_ids
    assert raw.encode(text, add_special_tokens=True).ids == raw.encode(text, add_special_tokens=False).ids
    assert hf.decode(hf(text, add_special_tokens=False).input_ids) == text


def test_every_ordinary_token_is_printable_ascii(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    special = set(tok.all_special_ids)
    assert len(special) == 5
    allowed = set("\t\n") | {chr(c) for c in range(0x20, 0x7F)}
    bad = []
    for i in range(len(tok)):
        if i in special:
            continue
        s = tok.decode([i])
        if not s or not set(s) <= allowed:
            bad.append((i, s))
    assert not bad, bad[:10]


def test_chat_template_variants(tiny_dir):
    from transformers import AutoProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    proc = AutoProcessor.from_pretrained(tiny_dir)
    cases = [
        ([{"role": "user", "content": "Hi there"}], "<s>USER: Hi there ASSISTANT:"),
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
            ],
            "<s>Be brief. USER: <image>\nWhat is this? ASSISTANT:",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare"},
                        {"type": "image"},
                        {"type": "image"},
                        {"type": "text", "text": "these."},
                    ],
                },
                {"role": "assistant", "content": "Two images."},
                {"role": "user", "content": [{"type": "text", "text": "And?"}]},
            ],
            "<s>USER: <image>\n<image>\nCompare these. ASSISTANT: Two images.</s>USER: And? ASSISTANT:",
        ),
    ]
    for messages, expected in cases:
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
        assert proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False, tokenize=False)
    assert no_prompt == "<s>USER: Hi "
    assert (tiny_dir / "chat_template.jinja").read_text() == json.loads(
        (tiny_dir / "tokenizer_config.json").read_text()
    )["chat_template"]


# --------------------------------------------------------------------------- oracle


def test_hf_generate_emits_ordinary_tokens(tiny_dir, summary, image_640x480):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    ref = oracle.hf_llava_generate(tiny_dir, messages, [image_640x480], max_new_tokens=8)
    assert ref["prompt_token_ids"].count(summary["image_token_id"]) == 576
    out = ref["output_token_ids"]
    assert len(out) == 8  # eos can never win: its lm_head row is zero
    special = {summary[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "image_token_id")}
    assert not special & set(out), out
    assert len(ref["gaps"]) == 8 and all(g >= 0 for g in ref["gaps"])
    oracle.assert_greedy_match(out, ref)

    # The image matters: another image gives another continuation or at least other gaps.
    from PIL import Image

    other = oracle.hf_llava_generate(tiny_dir, messages, [Image.new("RGB", (640, 480), (200, 30, 30))], 8)
    assert other["prompt_token_ids"] == ref["prompt_token_ids"]
    assert (other["output_token_ids"], other["gaps"]) != (out, ref["gaps"])

    # Text-only prompts work too (no image part, no images).
    text_only = oracle.hf_llava_generate(tiny_dir, [{"role": "user", "content": "Hello"}], [], 4)
    assert summary["image_token_id"] not in text_only["prompt_token_ids"]
    assert len(text_only["output_token_ids"]) == 4


def test_assert_greedy_match_rules():
    ref = {"output_token_ids": [5, 6, 7, 8], "gaps": [0.5, 0.0004, 0.3, 0.2]}
    oracle.assert_greedy_match([5, 6, 7, 8], ref)
    # first divergence at a near tie (gap 0.0004 < 1e-3): accepted, with a warning saying so
    with pytest.warns(UserWarning, match=r"diverged at token 1 where transformers' own top-1/top-2 log-prob gap is"):
        oracle.assert_greedy_match([5, 9, 1, 1], ref)
    # first divergence at a clear winner: fails, naming both sequences
    with pytest.raises(AssertionError, match=r"diverged at token 2 .*gap is 0.3 >= 0.001") as exc:
        oracle.assert_greedy_match([5, 6, 9, 8], ref)
    assert "[5, 6, 9, 8]" in str(exc.value) and "[5, 6, 7, 8]" in str(exc.value)
    # a length difference is not a near tie
    with pytest.raises(AssertionError, match="lengths differ"):
        oracle.assert_greedy_match([5, 6, 7], ref)


# --------------------------------------------------------------------------- dispatch / CLI


def test_unknown_family_and_size_errors(tmp_path):
    known = builders()
    assert {"llava", "qwen2_vl", "whisper"} <= set(known) and all(":" in v for v in known.values())
    with pytest.raises(ValueError, match="unknown model family 'nope'.*llava"):
        build_tiny("nope", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown size"):
        build_tiny("llava", tmp_path / "x", size="huge")
    proc = subprocess.run(
        [sys.executable, "-m", "vlmd.testing.tiny", "--family", "nope", "--out", str(tmp_path / "y")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown model family" in proc.stderr
    assert not (tmp_path / "y").exists()


# --------------------------------------------------------------------------- shared weights and files


def test_weights_draw_is_seeded_and_in_name_order():
    """vlmd.tiny.weights: the same seed gives the same tensors whatever torch's global RNG
    did; a rule's None keeps the constructor's tensor; the output rows named are zeroed; the
    common rule scales by name (norms, biases, embeddings, fan-in)."""
    import math

    import torch

    from vlmd.tiny.weights import StdRule, init_weights

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(64, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.q_proj = torch.nn.Linear(16, 16)
            self.o_proj = torch.nn.Linear(16, 16)
            self.pos = torch.nn.Parameter(torch.full((4, 16), 7.0))
            self.lm_head = torch.nn.Linear(16, 64, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

    rule = StdRule(fixed=[(("o_proj.weight",), 3.0, 0.0)])
    keep = lambda name, shape, is_norm: None if name == "pos" else rule(name, shape, is_norm)  # noqa: E731

    def build(seed):
        torch.manual_seed(seed + 100)  # the global RNG must not matter
        model = Toy()
        init_weights(model, seed, keep, zero_output_rows=[5, 9])
        return {name: param.detach().clone() for name, param in model.named_parameters()}

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["q_proj.weight"], c["q_proj.weight"])
    assert torch.equal(a["pos"], torch.full((4, 16), 7.0))  # kept as built
    assert not a["lm_head.weight"][[5, 9]].any() and a["lm_head.weight"][[0, 1]].all()
    assert torch.equal(a["o_proj.weight"], torch.full((16, 16), 3.0))  # fixed scale
    assert rule("layers.0.norm.weight", (16,), True) == (1.0, 0.1)
    assert rule("q_proj.bias", (16,), False) == (0.0, 0.02)
    assert rule("lm_head.weight", (64, 16), False) == (0.0, 2.0 / math.sqrt(16))
    assert rule("q_proj.weight", (16, 32), False) == (0.0, 1.0 / math.sqrt(32))
    assert rule("up_proj.weight", (16, 32), False) == (0.0, 0.5 / math.sqrt(32))


def test_family_builders_draw_and_write_through_vlmd_tiny():
    """Every family's tiny.py keeps its config, tokens and processor settings only: the
    seeded draw is vlmd.tiny.weights' and the stable JSON checkpoint_io's (one copy each)."""
    copies = []
    for path in sorted((REPO_ROOT / "plugins").glob("*/vlmd_*/tiny*.py")):
        text = path.read_text(encoding="utf-8")
        copies += [f"{path.relative_to(REPO_ROOT)}: {word}" for word in ("torch.Generator", "json.dumps") if word in text]
    assert copies == [], ("use vlmd.tiny.weights (random_model, StdRule) and vlmd.tiny.checkpoint_io "
                          f"(write_json, restamp_json, write_tokenizer): {copies}")
