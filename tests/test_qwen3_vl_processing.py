"""Qwen3-VL processing against transformers, without a server: image token counts (the
processing info, ``vlmd cost`` and the processor's expansion), M-RoPE positions, the
interleaved rotary tables, and the DeepStack rows the model hands its decoder.

Token counts of the sizes the issue names, under the tiny checkpoint's limits (4..64 tokens)
and under Qwen3-VL's published ones (65536..16777216 pixels, 16-px patches), are checked
against ``Qwen2VLImageProcessorPil`` (what Qwen3-VL checkpoints name, PIL backend).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from conftest import random_image
from qwen3_vl_oracle import load_hf_qwen3_vl
from vlmd.cost import CostOptions, compute_cost, parse_image
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd_qwen3_vl.model import interleaved_mrope
from vlmd_qwen3_vl.processing import Qwen3VLProcessingInfo, Qwen3VLProcessor

SIZES = [(57, 1900), (1900, 57), (1024, 1024), (4000, 3000), (640, 480), (33, 50), (3000, 17)]  # width, height
PUBLISHED = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}


def _processor(model_dir) -> Qwen3VLProcessor:
    ctx = ProcessingContext(str(model_dir), "tiny", AutoConfig.from_pretrained(model_dir),
                            AutoTokenizer.from_pretrained(model_dir))
    return Qwen3VLProcessor(Qwen3VLProcessingInfo(ctx))


@pytest.fixture(scope="module")
def published_dir(tiny_qwen3_vl_dir, tmp_path_factory):
    """The tiny checkpoint's config with Qwen3-VL's published image processor settings."""
    out = tmp_path_factory.mktemp("qwen3-vl-published")
    (out / "config.json").write_text((tiny_qwen3_vl_dir / "config.json").read_text())
    (out / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))
    return out


def test_item_tokens_equal_transformers(tiny_qwen3_vl_dir, published_dir):
    for model_dir in (tiny_qwen3_vl_dir, published_dir):
        config = json.loads((model_dir / "preprocessor_config.json").read_text())
        reference = Qwen2VLImageProcessorPil(patch_size=16, size=config["size"])
        ctx = ProcessingContext(str(model_dir), "m", AutoConfig.from_pretrained(model_dir), None)
        info = Qwen3VLProcessingInfo(ctx)
        counts = []
        for width, height in SIZES:
            tokens = info.item_tokens("image", ItemSize(width, height), {})
            counts.append(tokens.placeholders)
            assert tokens.placeholders == reference.get_number_of_image_patches(height, width, {}) // 4
            assert tokens.replacement == tokens.placeholders
        assert len(set(counts)) > 2  # sizes matter under both limits


def test_prompt_and_cost_equal_the_processors_count(tiny_qwen3_vl_dir):
    """The expanded prompt (what usage.prompt_tokens counts) and ``vlmd cost`` equal
    transformers' processor's ids for one prompt with the issue's three sizes."""
    sizes = [(57, 1900), (1024, 1024), (4000, 3000)]
    rng = np.random.default_rng(0)  # noise straight from numpy: a 4000x3000 image in a blink
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for width, height in sizes]
    messages = [{"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "What is here?"}]}]
    _, hf = load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    expected = hf(text=hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), images=images,
                  return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
    processor = _processor(tiny_qwen3_vl_dir)
    tokenizer = processor.info.ctx.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert processor.apply(prompt, {"image": images}).prompt_token_ids == expected
    report = compute_cost(str(tiny_qwen3_vl_dir), [parse_image(f"{w}x{h}") for w, h in sizes],
                          CostOptions(prompt="What is here?"))
    assert report["family"] == "qwen3_vl"
    assert report["prompt_tokens"] == len(expected)


def test_positions_equal_transformers(tiny_qwen3_vl_dir):
    images = [random_image(1, 320, 240), random_image(2, 100, 700)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "Compare them."}]}]
    model, hf = load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    inputs = hf(text=hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), images=images,
                return_tensors="pt", add_special_tokens=False)
    expected, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    output = _processor(tiny_qwen3_vl_dir).apply(
        [token for index, token in enumerate(ids) if token != model.config.image_token_id
         or ids[index - 1] != model.config.image_token_id], {"image": images})
    assert output.prompt_token_ids == ids
    state = output.family_state
    assert np.array_equal(state.table, expected[:, 0].numpy())
    assert state.delta == int(delta)
    # Generated tokens continue at index + delta in every row.
    assert state.positions(len(ids), len(ids) + 2, len(ids)).tolist() == [[len(ids) + state.delta,
                                                                           len(ids) + 1 + state.delta]] * 3


def test_interleaved_rotary_equals_transformers(tiny_qwen3_vl_dir):
    config = AutoConfig.from_pretrained(tiny_qwen3_vl_dir).text_config
    ours = interleaved_mrope(config)
    theirs = Qwen3VLTextRotaryEmbedding(config)
    positions = torch.stack([torch.arange(40), torch.arange(40) // 3 + 5, torch.arange(40) % 7 + 9])
    cos, sin = ours.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin[:, 0], ref_sin[0])
    # Not the sectioned layout: the rows' columns differ.
    assert not torch.equal(ours.row_of_column, torch.repeat_interleave(torch.arange(3), torch.tensor([2, 3, 3])).repeat(2))


def test_merge_multimodal_splits_rows_into_embeddings_and_deepstack_additions(tiny_qwen3_vl_dir):
    """The model splits each encoder row into its placeholder's embedding, written in
    place, and one addition per DeepStack layer, handed back for the decoder."""
    from vlmd_qwen3_vl.model import Qwen3VLModel

    config = AutoConfig.from_pretrained(tiny_qwen3_vl_dir)
    model = Qwen3VLModel.load(tiny_qwen3_vl_dir, config, torch.float32)
    hidden, layers = config.text_config.hidden_size, len(config.vision_config.deepstack_visual_indexes)
    assert _processor(tiny_qwen3_vl_dir).info.encoder_output_width() == model.encoder_output_width
    embeds = torch.zeros(6, hidden)
    rows = torch.tensor([2, 3])
    features = torch.arange(2 * hidden * (1 + layers), dtype=torch.float32).view(2, -1)
    rows_back, additions = model.merge_multimodal(embeds, rows, features)
    assert torch.equal(embeds[2:4], features[:, :hidden]) and not embeds[[0, 1, 4, 5]].any()
    assert torch.equal(rows_back, rows) and additions.shape == (layers, 2, hidden)
    for layer in range(layers):
        assert torch.equal(additions[layer], features[:, hidden * (1 + layer) : hidden * (2 + layer)])
