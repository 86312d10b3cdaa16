"""Llama 3.2 Vision processing against transformers, without a server: the canvas, resized
size and aspect-ratio id for many sizes (the published settings and the tiny ones), the tiles
bit for bit with the PIL image processor, the cross-attention mask of several prompt layouts,
the tower + projector output, ``item_tokens`` / ``vlmd cost``, and the kwargs rule.

Published settings (560-px tiles, at most 4): a 1120x1120 image is a 2x2 canvas, a 4000x600
strip 1x4, a 100x100 icon one tile (scaled up to 560); every image costs the tower 4 x 1,601
vectors (40x40 patches and a class token per tile, the padding tiles included).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, MllamaImageProcessorPil
from transformers.models.mllama.image_processing_pil_mllama import (
    get_image_size_fit_to_canvas,
    get_optimal_tiled_canvas,
)

from conftest import random_image
from mllama_oracle import hf_mllama_inputs, load_hf_mllama
from vlmd.cost import CostOptions, compute_cost, format_table, parse_image
from vlmd.errors import BadRequestError
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd_mllama.layout import row_masks
from vlmd_mllama.model import MllamaModel
from vlmd_mllama.processing import MllamaDummyInputsBuilder, MllamaProcessingInfo, MllamaProcessor
from vlmd_mllama.tiles import TileSettings, canvas_for, fit_to_canvas, optimal_canvas

NAMED_SIZES = [(1120, 1120), (4000, 600), (600, 4000), (100, 100), (1, 1), (2, 20000), (640, 480), (560, 560),
               (561, 559), (300, 40), (40, 300), (50, 40), (56, 56), (57, 112)]  # (width, height)


def _sizes(count: int = 300) -> list[tuple[int, int]]:
    rng = np.random.default_rng(0)
    return [(int(w), int(h)) for w, h in rng.integers(1, 5000, size=(count, 2))] + NAMED_SIZES


@pytest.mark.parametrize("tile,max_tiles", [(560, 4), (56, 2), (448, 6)])
def test_canvas_and_size_equal_transformers(tile, max_tiles):
    for width, height in _sizes():
        canvas = get_optimal_tiled_canvas(height, width, max_tiles, tile)
        assert optimal_canvas(height, width, max_tiles, tile) == tuple(int(x) for x in canvas), (width, height)
        assert fit_to_canvas(height, width, *canvas, tile) == tuple(
            int(x) for x in get_image_size_fit_to_canvas(height, width, *canvas, tile)), (width, height)


def test_published_settings():
    settings = TileSettings(tile_size=560, max_image_tiles=4)
    assert (canvas_for(1120, 1120, settings).rows, canvas_for(1120, 1120, settings).columns) == (2, 2)
    assert (canvas_for(600, 4000, settings).rows, canvas_for(600, 4000, settings).columns) == (1, 4)
    assert canvas_for(100, 100, settings).tiles == 1
    reference = MllamaImageProcessorPil(size={"height": 560, "width": 560}, max_image_tiles=4)
    for width, height in NAMED_SIZES[:8]:
        image = random_image(1, min(width, 1200), min(height, 1200))
        ours = canvas_for(image.height, image.width, settings)
        theirs = reference(image, return_tensors="np")
        assert int(theirs["aspect_ratio_ids"][0, 0]) == ours.aspect_ratio_id
        assert theirs["num_tiles"] == [[ours.tiles]]


def _processor(model_dir, **server_kwargs) -> MllamaProcessor:
    ctx = ProcessingContext(str(model_dir), "tiny", AutoConfig.from_pretrained(model_dir),
                            AutoTokenizer.from_pretrained(model_dir), mm_processor_kwargs=server_kwargs)
    return MllamaProcessor(MllamaProcessingInfo(ctx))


LAYOUTS = {  # parts of one user message: text, or (seed, width, height) of an image
    "one": [(1, 50, 40), "What is it?"],
    "strips": [(2, 300, 40), (3, 40, 300), "Compare."],
    "text_first": ["Look:", (4, 90, 60), "and", (5, 200, 200), "then?"],
    "adjacent_then_text": ["Hi", (6, 1, 1), (7, 2000, 20), "x"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_processor_equals_transformers(tiny_mllama_dir, name):
    parts = LAYOUTS[name]
    images = [random_image(*part) for part in parts if not isinstance(part, str)]
    messages = [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                                             for p in parts]}]
    inputs, prompt = hf_mllama_inputs(tiny_mllama_dir, messages, images)
    processor = _processor(tiny_mllama_dir)
    ids = processor.info.ctx.tokenizer.encode(prompt, add_special_tokens=False)
    output = processor.apply(ids, {"image": images})
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert [item.offset for item in output.items] == [0] * len(images)
    assert all(item.length == 0 for item in output.items)
    info = processor.info
    for index, item in enumerate(output.items):
        tiles = item.encoder_inputs["tiles"]
        assert item.encoder_inputs["aspect_ratio_id"] == int(inputs["aspect_ratio_ids"][0, index])
        assert inputs["aspect_ratio_mask"][0, index].tolist() == [1] * len(tiles) + [0] * (info.max_tiles - len(tiles))
        pixels = (torch.from_numpy(tiles).float() * info.settings.rescale_factor
                  - torch.tensor(info.settings.mean).view(1, 3, 1, 1)) / torch.tensor(info.settings.std).view(1, 3, 1, 1)
        assert torch.allclose(pixels, inputs["pixel_values"][0, index, : len(tiles)], atol=1e-6)
        assert not inputs["pixel_values"][0, index, len(tiles):].any()
        width, height = images[index].size
        assert info.item_tokens("image", ItemSize(width, height), {}).encoder_tokens == item.num_encoder_tokens
    # Each row's allowed vision tokens: transformers' mask where a row has any, else all of them.
    mask = inputs["cross_attention_mask"][0]
    expected = mask.repeat_interleave(info.tokens_per_tile, dim=2).reshape(mask.shape[0], -1).bool()
    covered = expected.any(dim=1)
    positions = torch.arange(len(ids) + 2)  # two generated tokens attend as the last prompt token
    allowed, ours_covered = row_masks(output.family_state, positions, info.max_tiles, info.tokens_per_tile)
    assert ours_covered[: len(ids)].tolist() == covered.tolist()
    assert torch.equal(allowed[: len(ids)][covered], expected[covered])
    assert allowed[: len(ids)][~covered].all()
    assert torch.equal(allowed[len(ids):], allowed[len(ids) - 1].expand(2, -1))


def test_tower_and_projector_equal_transformers(tiny_mllama_dir):
    parts = LAYOUTS["strips"]
    images = [random_image(*part) for part in parts if not isinstance(part, str)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "x"}]}]
    inputs, prompt = hf_mllama_inputs(tiny_mllama_dir, messages, images)
    processor = _processor(tiny_mllama_dir)
    output = processor.apply(processor.info.ctx.tokenizer.encode(prompt, add_special_tokens=False), {"image": images})
    model = MllamaModel.load(tiny_mllama_dir, AutoConfig.from_pretrained(tiny_mllama_dir), torch.float32)
    hf_model, _ = load_hf_mllama(tiny_mllama_dir)
    with torch.inference_mode():
        vision = hf_model.model.vision_model(pixel_values=inputs["pixel_values"], aspect_ratio_ids=inputs["aspect_ratio_ids"],
                                             aspect_ratio_mask=inputs["aspect_ratio_mask"]).last_hidden_state
        hidden = hf_model.config.text_config.hidden_size
        theirs = hf_model.model.multi_modal_projector(vision).reshape(len(images), -1, hidden)
        ours = model.embed_multimodal("image", [item.encoder_inputs for item in output.items])
    for mine, reference in zip(ours, theirs):
        assert torch.allclose(mine, reference, atol=1e-5)


def test_cost_and_item_tokens(tiny_mllama_dir):
    report = compute_cost(str(tiny_mllama_dir), [parse_image("300x40"), parse_image("50x40")],
                          CostOptions(prompt="Compare them."))
    assert [row["layout"] for row in report["items"]] == [
        {"grid": "2x1", "tiles": 2, "padding_tiles": 0, "tokens_per_tile": 17},
        {"grid": "1x1", "tiles": 1, "padding_tiles": 1, "tokens_per_tile": 17},
    ]
    assert [(row["prompt_tokens"], row["encoder_tokens"]) for row in report["items"]] == [(1, 34), (1, 34)]
    messages = [{"role": "user", "content": [{"type": "image"}] * 2 + [{"type": "text", "text": "Compare them."}]}]
    inputs, _ = hf_mllama_inputs(tiny_mllama_dir, messages, [random_image(1, 300, 40), random_image(2, 50, 40)])
    assert report["requests"][0]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert "image 300x40 (grid 2x1, tiles 2, padding_tiles 0, tokens_per_tile 17)" in format_table(report)


def test_kwargs_are_refused_and_the_dummy_fills_every_tile(tiny_mllama_dir):
    processor = _processor(tiny_mllama_dir)
    with pytest.raises(BadRequestError, match="max_image_tiles"):
        processor.process_item("image", random_image(1, 80, 80), {"max_image_tiles": 1})
    dummy = MllamaDummyInputsBuilder(processor.info).dummy_item("image")
    assert processor.process_item("image", dummy, {}).encoder_inputs["tiles"].shape[0] == processor.info.max_tiles


def test_block_hashes_name_the_images(tiny_mllama_dir):
    """Items at offset 0 without placeholders key the first block, hence every later one."""
    from vlmd.sched.block_hash import extend_block_hashes

    processor = _processor(tiny_mllama_dir)
    prompt = processor.info.ctx.tokenizer.encode("<|begin_of_text|><|image|>" + "word " * 40, add_special_tokens=False)
    hashes = []
    for seed in (1, 2):
        output = processor.apply(prompt, {"image": [random_image(seed, 80, 60)]})
        chain: list[bytes] = []
        extend_block_hashes(chain, output.prompt_token_ids, output.items, 16)
        hashes.append(chain)
    assert len(hashes[0]) >= 2 and all(a != b for a, b in zip(*hashes))


def test_images_needed_together_must_fit_the_encoder_budget_together():
    """Every image of a request is encoded with its first chunk: two of 40 vectors exceed a
    budget of 64 together (a 400 on arrival, not a request that waits forever), one fits."""
    from sched_support import make_request, make_scheduler
    from vlmd.errors import RequestRejected
    from vlmd.types import MultiModalItem

    def image(name):
        return MultiModalItem("image", name, offset=0, length=0, encoder_tokens=40)

    scheduler = make_scheduler()
    with pytest.raises(RequestRejected, match="80 encoder tokens at once"):
        scheduler.add_request(make_request("two", 12, items=(image("a"), image("b"))))
    scheduler.add_request(make_request("one", 12, items=(image("a"),)))
    out = scheduler.schedule()
    assert out.scheduled_encoder_inputs == {"one": [0]}


def test_both_checkpoint_layouts_load_the_same_weights(tiny_mllama_dir, tmp_path):
    """transformers 5 saves the published layout (``language_model.model.``,
    ``language_model.lm_head.``, ``vision_model.``); its module names (``model.language_model.``,
    ``lm_head.``, ``model.vision_model.``) load alike, and a missing weight is a clear error."""
    import shutil

    from safetensors.torch import load_file, save_file

    published = load_file(tiny_mllama_dir / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in published)
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_model.", "model.vision_model."), ("multi_modal_projector.", "model.multi_modal_projector."))
    modern = {}
    for name, tensor in published.items():
        old, new = next((old, new) for old, new in renames if name.startswith(old))
        modern[new + name[len(old):]] = tensor
    copy = shutil.copytree(tiny_mllama_dir, tmp_path / "mllama-v5-names")
    save_file(modern, copy / "model.safetensors")
    config = AutoConfig.from_pretrained(tiny_mllama_dir)
    ours = MllamaModel.load(tiny_mllama_dir, config, torch.float32).state_dict()
    theirs = MllamaModel.load(copy, config, torch.float32).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    save_file({name: t for name, t in modern.items() if "cross_attn_mlp_gate" not in name}, copy / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 2 weights"):
        MllamaModel.load(copy, config, torch.float32)
