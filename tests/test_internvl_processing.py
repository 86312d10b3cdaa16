"""InternVL processing against transformers, without a server: the tile grid and token
counts (``item_tokens``, ``vlmd cost``) for many sizes and limits, the tiles bit for bit with
the PIL image processor, placeholder expansion, the tower + pixel shuffle + projector, and
the mm_processor_kwargs rules.

Token counts (InternVL3's published settings: 448-px tiles, 1..12 tiles, 256 tokens a tile):
57x1900 is a 1x12 grid + thumbnail = 3,328 tokens; 1024x1024 a 3x3 grid + thumbnail = 2,560
(square grids tie on aspect ratio, and the larger wins while the image covers over half of
it); 4000x3000 a 4x3 grid + thumbnail = 3,328; a 448x448 image one tile, 256.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer, GotOcr2ImageProcessorPil
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from conftest import random_image
from internvl_support import load_hf_internvl
from vlmd.cost import CostOptions, compute_cost, format_table, parse_image
from vlmd.errors import BadRequestError
from vlmd.media.image import to_rgb
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd_internvl.processing import InternVLDummyInputsBuilder, InternVLProcessingInfo, InternVLProcessor
from vlmd_internvl.settings import read_pixel_norm
from vlmd_internvl.tiling import TileSettings, optimal_grid

NAMED_SIZES = [(57, 1900), (1900, 57), (1024, 1024), (4000, 3000), (3000, 4000), (448, 448), (1, 1), (2, 20000),
               (640, 480), (480, 640), (896, 448), (100, 90), (224, 224), (1344, 896)]  # (width, height)


def _random_sizes(count: int = 300) -> list[tuple[int, int]]:
    rng = np.random.default_rng(0)
    return [(int(w), int(h)) for w, h in rng.integers(1, 5000, size=(count, 2))] + NAMED_SIZES


def _processor(model_dir, **server_kwargs) -> InternVLProcessor:
    ctx = ProcessingContext(str(model_dir), "tiny", AutoConfig.from_pretrained(model_dir),
                            AutoTokenizer.from_pretrained(model_dir), mm_processor_kwargs=server_kwargs)
    return InternVLProcessor(InternVLProcessingInfo(ctx))


@pytest.mark.parametrize("limits", [(1, 12), (1, 6), (2, 6), (1, 40), (3, 3)])
def test_grid_equals_transformers(limits):
    for width, height in _random_sizes():
        for tile in (448, 112):
            assert optimal_grid(height, width, tile, tile, *limits) == \
                get_optimal_tiled_canvas((height, width), (tile, tile), *limits), (width, height, tile)


def test_published_settings_token_counts():
    """InternVL3's settings (448-px tiles, 1..12, 256 a tile) against transformers' own count."""
    settings = TileSettings(448, 448, 1, 12, 256)
    reference = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=True,
                                         min_patches=1, max_patches=12)
    for width, height in _random_sizes():
        assert settings.grid(height, width).tiles == reference.get_number_of_image_patches(height, width), (width, height)
    counts = {size: settings.grid(size[1], size[0]).tiles * 256 for size in [(57, 1900), (1024, 1024), (4000, 3000)]}
    assert counts == {(57, 1900): 3328, (1024, 1024): 2560, (4000, 3000): 3328}
    assert settings.grid(448, 448).tiles == 1 and not settings.grid(448, 448).thumbnail


@pytest.mark.parametrize("kwargs", [{}, {"max_patches": 2}, {"min_patches": 3}, {"max_dynamic_patch": 4}, {"max_patches": 1}])
def test_item_tokens_equal_the_processors_count(tiny_internvl_dir, kwargs):
    info = _processor(tiny_internvl_dir).info
    _, hf = load_hf_internvl(tiny_internvl_dir)
    hf_kwargs = {{"max_dynamic_patch": "max_patches"}.get(k, k): v for k, v in kwargs.items()}
    for width, height in _random_sizes(100):
        tokens = info.item_tokens("image", ItemSize(width, height), kwargs)
        reference = hf._get_num_multimodal_tokens(image_sizes=[(height, width)], **hf_kwargs)
        assert tokens.placeholders == tokens.encoder_tokens == reference["num_image_tokens"][0], (width, height)
        assert tokens.replacement == tokens.placeholders + 2  # <img> ... </img>
        layout = tokens.layout
        assert layout["tiles"] + layout["thumbnail"] == reference["num_image_patches"][0]


def _images():
    rng = np.random.default_rng(1)
    sizes = [(640, 430), (1900, 57), (57, 1900), (100, 90), (112, 112), (33, 50), (800, 400)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400, 4), dtype=np.uint8), "RGBA"))
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400), dtype=np.uint8), "L"))
    return images


def _normalised(processor: InternVLProcessor, tiles: np.ndarray) -> torch.Tensor:
    """The model's normalisation (``InternVLModel.embed_multimodal``) of uint8 tiles."""
    norm = read_pixel_norm(processor.info.ctx.model_dir)
    mean, std = torch.tensor(norm.mean).view(1, 3, 1, 1), torch.tensor(norm.std).view(1, 3, 1, 1)
    return (torch.from_numpy(tiles).to(torch.float32) / 255.0 - mean) / std


def test_tiles_equal_transformers_bit_for_bit(tiny_internvl_dir):
    _, hf = load_hf_internvl(tiny_internvl_dir)
    processor = _processor(tiny_internvl_dir)
    for index, image in enumerate(_images()):
        reference = hf.image_processor(image, crop_to_patches=True, return_tensors="pt")
        item = processor.process_item("image", to_rgb(image), {})
        ours = _normalised(processor, item.encoder_inputs["tiles"])
        assert reference["num_patches"].tolist() == [len(ours)], index
        assert torch.equal(ours, reference["pixel_values"]), (index, (ours - reference["pixel_values"]).abs().max())


def test_prompt_expansion_equals_transformers(tiny_internvl_dir):
    images = [random_image(3, 640, 430), random_image(4, 96, 300)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                             {"type": "text", "text": "What changed?"}]}]
    _, hf = load_hf_internvl(tiny_internvl_dir)
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reference = hf(text=prompt, images=images, return_tensors="pt", add_special_tokens=False)
    processor = _processor(tiny_internvl_dir)
    ours = processor.apply(processor.info.ctx.tokenizer.encode(prompt, add_special_tokens=False), {"image": images})
    assert ours.prompt_token_ids == reference["input_ids"][0].tolist()
    assert [(item.length, len(item.encoder_inputs["tiles"])) for item in ours.items] == [(7 * 16, 7), (4 * 16, 4)]
    for item in ours.items:
        run = ours.prompt_token_ids[item.offset - 1 : item.end + 1]
        assert run[0] == processor.info.start_token_id and run[-1] == processor.info.end_token_id


def test_tower_shuffle_and_projector_equal_transformers(tiny_internvl_dir):
    from transformers import AutoConfig as Config

    from vlmd_internvl.model import InternVLModel

    hf_model, hf = load_hf_internvl(tiny_internvl_dir)
    ours = InternVLModel.load(tiny_internvl_dir, Config.from_pretrained(tiny_internvl_dir), torch.float32)
    processor = _processor(tiny_internvl_dir)
    images = [random_image(5, 640, 430), random_image(6, 100, 90)]
    items = [processor.process_item("image", image, {}).encoder_inputs for image in images]
    with torch.inference_mode():
        features = ours.embed_multimodal("image", items)
        pixel_values = hf.image_processor(images, crop_to_patches=True, return_tensors="pt")["pixel_values"]
        reference = hf_model.get_image_features(pixel_values=pixel_values).pooler_output
    assert [f.shape for f in features] == [(7 * 16, 64), (16, 64)]
    assert torch.allclose(torch.cat(features), reference.reshape(-1, 64), atol=1e-5)


def test_vlmd_cost_shows_the_tiles_and_equals_the_processor(tiny_internvl_dir):
    _, hf = load_hf_internvl(tiny_internvl_dir)
    items = [parse_image("640x430"), parse_image("100x90"), parse_image("57x1900")]
    report = compute_cost(str(tiny_internvl_dir), items, CostOptions(prompt="Compare them."))
    assert [row["layout"] for row in report["items"]] == [
        {"grid": "3x2", "tiles": 6, "thumbnail": 1, "tokens_per_tile": 16},
        {"grid": "1x1", "tiles": 1, "thumbnail": 0, "tokens_per_tile": 16},
        {"grid": "1x6", "tiles": 6, "thumbnail": 1, "tokens_per_tile": 16},
    ]
    messages = [{"role": "user", "content": [{"type": "image"}] * 3 + [{"type": "text", "text": "Compare them."}]}]
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [Image.new("RGB", size) for size in [(640, 430), (100, 90), (57, 1900)]]
    reference = hf(text=prompt, images=images, return_tensors="pt", add_special_tokens=False)
    assert report["prompt_tokens"] == reference["input_ids"].shape[1]
    assert "image 640x430 (grid 3x2, tiles 6, thumbnail 1, tokens_per_tile 16)" in format_table(report)
    capped = compute_cost(str(tiny_internvl_dir), [parse_image("800x400")],
                          CostOptions(mm_processor_kwargs={"max_patches": 2}))
    assert capped["items"][0]["layout"]["grid"] == "2x1" and capped["items"][0]["prompt_tokens"] == 3 * 16 + 2


def test_processor_kwargs_rules(tiny_internvl_dir):
    processor = _processor(tiny_internvl_dir)
    image = random_image(5, 800, 400)
    assert len(processor.process_item("image", image, {}).encoder_inputs["tiles"]) == 3  # 2x1 + thumbnail
    assert len(processor.process_item("image", image, {"min_patches": 3}).encoder_inputs["tiles"]) == 7  # 3x2
    assert len(processor.process_item("image", image, {"max_patches": 2}).encoder_inputs["tiles"]) == 3
    assert len(processor.process_item("image", image, {"max_dynamic_patch": 1}).encoder_inputs["tiles"]) == 1
    for kwargs, message in [
        ({"max_patches": 7}, "exceeds this server's limit of 6 tiles"),
        ({"max_pixels": 2}, "unknown mm_processor_kwargs"),
        ({"max_patches": "4"}, "positive integer"),
        ({"max_patches": True}, "positive integer"),
        ({"min_patches": 4, "max_patches": 2}, "larger than max_patches"),
        ({"max_patches": 2, "max_dynamic_patch": 3}, "twice with different values"),
    ]:
        with pytest.raises(BadRequestError, match=message):
            processor.process_item("image", image, kwargs)
    # Server-wide kwargs move the ceiling (and the identifier covers the merged kwargs).
    raised = _processor(tiny_internvl_dir, max_patches=12)
    output = raised.apply([raised.info.marker_token_id("image")], {"image": [random_image(6, 1900, 57)]})
    assert len(output.prompt_token_ids) == 13 * 16 + 2  # a 12x1 grid + thumbnail: over the checkpoint's 6
    assert raised.identifier("image", image, {"max_patches": 12}) != processor.identifier("image", image, {})


def test_dummy_item_is_the_largest(tiny_internvl_dir):
    for server_kwargs, tiles in [({}, 7), ({"max_patches": 3}, 4), ({"max_patches": 1}, 1)]:
        processor = _processor(tiny_internvl_dir, **server_kwargs)
        dummy = InternVLDummyInputsBuilder(processor.info).dummy_item("image")
        assert len(processor.process_item("image", dummy, server_kwargs).encoder_inputs["tiles"]) == tiles


def test_tiny_checkpoint_loads_offline_with_every_weight(tiny_internvl_dir):
    from safetensors import safe_open
    from transformers import InternVLForConditionalGeneration

    _, info = InternVLForConditionalGeneration.from_pretrained(tiny_internvl_dir, output_loading_info=True)
    assert not any(info.values()), info
    summary = json.loads((tiny_internvl_dir / "vlmd_tiny.json").read_text())
    special = [summary[key] for key in ("image_token_id", "start_image_token_id", "end_image_token_id", "pad_token_id")]
    with safe_open(tiny_internvl_dir / "model.safetensors", "pt") as weights:
        lm_head = weights.get_tensor(next(name for name in weights.keys() if name.endswith("lm_head.weight")))
    assert not lm_head[special + summary["eos_token_ids"]].any() and lm_head[:100].abs().sum() > 0


@pytest.mark.parametrize("num_frames", [1, 2, 5, 8])
def test_video_expansion_and_counts_equal_transformers(tiny_internvl_dir, num_frames):
    """A video's "FrameN:" labels and one tile per frame, as InternVLProcessor expands them
    (frames through the stand-in video processor: transformers' PIL image processor)."""
    video = np.stack([np.asarray(random_image(seed, 112, 84)) for seed in range(num_frames)])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Watch:"}, {"type": "video"},
                                             {"type": "text", "text": "What happens?"}]}]
    _, hf = load_hf_internvl(tiny_internvl_dir)
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reference = hf(text=prompt, videos=[video], return_tensors="pt", add_special_tokens=False)
    processor = _processor(tiny_internvl_dir)
    ours = processor.apply(processor.info.ctx.tokenizer.encode(prompt, add_special_tokens=False), {"video": [video]})
    assert ours.prompt_token_ids == reference["input_ids"][0].tolist()
    (item,) = ours.items
    tokens = processor.info.item_tokens("video", ItemSize(112, 84, num_frames), {})
    assert tokens.replacement == len(reference["input_ids"][0]) - len(processor.info.ctx.tokenizer.encode(
        prompt, add_special_tokens=False)) + 1
    assert (item.length, tokens.placeholders) == (tokens.encoder_tokens, tokens.encoder_tokens)
    span = ours.prompt_token_ids[item.offset : item.end]
    assert span.count(processor.info.context_token_id) == 16 * num_frames
    assert span[0] == span[-1] == processor.info.context_token_id
    frames = _normalised(processor, item.encoder_inputs["tiles"])
    assert torch.equal(frames, reference["pixel_values"])


def test_vlmd_cost_counts_a_video(tiny_internvl_dir):
    from vlmd.cost import parse_video

    report = compute_cost(str(tiny_internvl_dir), [parse_video("16x112x84", 30.0)],
                          CostOptions(media_io_kwargs={"video": {"num_frames": 4}}))
    (row,) = report["items"]
    assert row["frames"] == 4 and row["layout"] == {"frames": 4, "tokens_per_frame": 16}
    processor = _processor(tiny_internvl_dir)
    assert row["prompt_tokens"] == processor.info.item_tokens("video", ItemSize(112, 84, 4), {}).replacement


def test_frames_of_another_size_leave_an_images_only_checkpoint(tiny_internvl_dir, tmp_path):
    """The reference gives a frame one tile's placeholders whatever its size: a video
    processor resizing to another size could not be encoded, so video is off (images stay)."""
    import shutil

    copy = shutil.copytree(tiny_internvl_dir, tmp_path / "internvl-56px-frames")
    for name in ("processor_config.json", "video_preprocessor_config.json"):
        config = json.loads((copy / name).read_text())
        (config.get("video_processor") or config)["size"] = {"height": 56, "width": 56}
        (copy / name).write_text(json.dumps(config))
    processor = _processor(copy)
    assert processor.info.supported_mm_limits() == {"image": None}
    with pytest.raises(BadRequestError, match="takes no video"):
        processor.process_item("video", np.zeros((2, 84, 112, 3), dtype=np.uint8), {})
    assert len(processor.process_item("image", random_image(1, 640, 430), {}).encoder_inputs["tiles"]) == 7


def test_tiled_even_where_the_image_processor_says_crop_to_patches_false(tiny_internvl_dir, tmp_path):
    """Published InternVL3 configs say ``crop_to_patches: false``; InternVLProcessor's own
    default turns it on, so their images are tiled all the same."""
    import shutil

    copy = shutil.copytree(tiny_internvl_dir, tmp_path / "internvl-crop-false")
    for name in ("processor_config.json", "preprocessor_config.json"):
        config = json.loads((copy / name).read_text())
        (config.get("image_processor") or config)["crop_to_patches"] = False
        (copy / name).write_text(json.dumps(config))
    _, hf = load_hf_internvl(copy)
    assert hf.image_processor.crop_to_patches is False
    image = random_image(1, 640, 430)
    reference = hf(text="<IMG_CONTEXT>", images=[image], return_tensors="pt")
    assert len(_processor(copy).process_item("image", image, {}).encoder_inputs["tiles"]) == \
        len(reference["pixel_values"]) == 7


def test_both_checkpoint_layouts_load_the_same_weights(tiny_internvl_dir, tmp_path):
    """transformers 5 saves this checkpoint in the 4.x layout the published -hf checkpoints use
    (``vision_tower.``, ``language_model.model.``, ``language_model.lm_head.``); its own module
    names (``model.vision_tower.``, ``model.language_model.``, ``lm_head.``) load alike."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig as Config

    from vlmd_internvl.model import InternVLModel

    legacy = load_file(tiny_internvl_dir / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in legacy)
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
    modern = {}
    for name, tensor in legacy.items():
        old, new = next((old, new) for old, new in renames if name.startswith(old))
        modern[new + name[len(old):]] = tensor
    copy = shutil.copytree(tiny_internvl_dir, tmp_path / "internvl-v5-names")
    save_file(modern, copy / "model.safetensors")
    config = Config.from_pretrained(tiny_internvl_dir)
    ours = {name: p for name, p in InternVLModel.load(tiny_internvl_dir, config, torch.float32).state_dict().items()}
    theirs = InternVLModel.load(copy, config, torch.float32).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    missing = {name: tensor for name, tensor in modern.items() if "multi_modal_projector.linear_2.bias" not in name}
    save_file(missing, copy / "model.safetensors")
    with pytest.raises(ValueError, match="InternVL checkpoint lacks weights"):
        InternVLModel.load(copy, config, torch.float32)
