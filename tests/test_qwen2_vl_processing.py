"""Qwen2-VL processing against transformers, without a server: smart-resize token counts,
pixels (bit for bit with the PIL image processor), placeholder expansion, M-RoPE positions
and rotary tables, and the mm_processor_kwargs rules.

Token counts of a 1344x1344 image (recorded for the issue):
- tiny checkpoint (max_pixels 128*28*28): 121; with max_pixels=32*28*28: 25;
- Qwen2-VL-7B defaults (min_pixels 56*56, max_pixels 28*28*1280): 1225 (a 980x980 resize);
  with the max_pixels its published preprocessor_config.json names (12845056): 2304.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from conftest import random_image
from oracle import hf_qwen2_vl_generate, load_hf_qwen2_vl
from vlmd.errors import BadRequestError
from vlmd.layers.rotary import MRotaryEmbedding, mrope_section, rope_parameters
from vlmd.media.image import to_rgb
from vlmd.processing.base import ProcessingContext
from vlmd_qwen2_vl.model import patchify
from vlmd_qwen2_vl.positions import mrope_positions
from vlmd_qwen2_vl.processing import Qwen2VLDummyInputsBuilder, Qwen2VLProcessingInfo, Qwen2VLProcessor
from vlmd_qwen2_vl.settings import VisionSettings, num_tokens, smart_resize

QWEN2_VL_7B = VisionSettings(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)


def _processor(model_dir, **server_kwargs) -> Qwen2VLProcessor:
    ctx = ProcessingContext(str(model_dir), "tiny", AutoConfig.from_pretrained(model_dir),
                            AutoTokenizer.from_pretrained(model_dir), mm_processor_kwargs=server_kwargs)
    return Qwen2VLProcessor(Qwen2VLProcessingInfo(ctx))


def _patches(processor: Qwen2VLProcessor, modality: str, pixels: np.ndarray) -> torch.Tensor:
    settings = processor.info.settings[modality]
    return patchify(torch.from_numpy(pixels), torch.tensor(settings.mean), torch.tensor(settings.std), settings)


def test_smart_resize_equals_transformers():
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(2, 4000, size=(300, 2)) if max(h, w) / min(h, w) <= 200]
    for limits in ((56 * 56, 28 * 28 * 1280), (4 * 784, 128 * 784), (4 * 784, 16 * 784)):
        for height, width in sizes + [(1344, 1344), (200, 1500), (1500, 200), (28, 5600)]:
            assert smart_resize(height, width, 28, *limits) == hf_smart_resize(height, width, 28, *limits)


def test_token_counts(tiny_qwen2_vl_dir):
    tiny = _processor(tiny_qwen2_vl_dir).info.settings["image"]
    assert num_tokens(1344, 1344, tiny) == 121
    assert num_tokens(1344, 1344, tiny.with_kwargs({"max_pixels": 32 * 28 * 28})) == 25
    assert num_tokens(1344, 1344, QWEN2_VL_7B) == 1225
    assert num_tokens(1344, 1344, QWEN2_VL_7B.with_kwargs({"max_pixels": 12845056})) == 2304
    reference = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    for height, width in [(1344, 1344), (480, 640), (200, 1500), (10, 10), (3000, 17)]:
        assert num_tokens(height, width, QWEN2_VL_7B) == reference.get_number_of_image_patches(height, width) // 4
    video = _processor(tiny_qwen2_vl_dir).info.settings["video"]  # 64 tokens per frame pair at most
    assert num_tokens(84, 112, video, num_frames=8) == 4 * 12
    assert num_tokens(84, 112, video, num_frames=7) == 4 * 12  # the odd last frame is repeated


def _images():
    rng = np.random.default_rng(1)
    sizes = [(640, 480), (1500, 200), (200, 1500), (1344, 1344), (33, 50), (641, 479)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400, 4), dtype=np.uint8), "RGBA"))
    images.append(Image.fromarray(rng.integers(0, 255, (300, 400), dtype=np.uint8), "L"))
    return images


@pytest.mark.parametrize("index", range(8))
def test_image_pixels_equal_transformers(tiny_qwen2_vl_dir, index):
    image = _images()[index]
    _, hf = load_hf_qwen2_vl(tiny_qwen2_vl_dir)
    reference = hf.image_processor(image, return_tensors="pt")
    processor = _processor(tiny_qwen2_vl_dir)
    item = processor.process_item("image", to_rgb(image), {})
    assert [list(item.encoder_inputs["grid_thw"])] == reference["image_grid_thw"].tolist()
    ours = _patches(processor, "image", item.encoder_inputs["pixels"])
    assert torch.equal(ours, reference["pixel_values"]), (ours - reference["pixel_values"]).abs().max()


def test_video_pixels_equal_the_reference_frames(tiny_qwen2_vl_dir):
    frames = np.stack([np.asarray(random_image(seed, 112, 84)) for seed in range(7)])
    _, hf = load_hf_qwen2_vl(tiny_qwen2_vl_dir)
    reference = hf.video_processor([frames])
    processor = _processor(tiny_qwen2_vl_dir)
    item = processor.process_item("video", frames, {})
    assert [list(item.encoder_inputs["grid_thw"])] == reference["video_grid_thw"].tolist() == [[4, 6, 8]]
    assert torch.equal(_patches(processor, "video", item.encoder_inputs["pixels"]), reference["pixel_values_videos"])


def test_prompt_and_mrope_positions_equal_transformers(tiny_qwen2_vl_dir):
    images = [random_image(3, 640, 480), random_image(4, 96, 300)]
    video = np.stack([np.asarray(random_image(seed, 112, 84)) for seed in range(8)])
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}, {"type": "image"},
             {"type": "text", "text": "What changed?"}]
    messages = [{"role": "user", "content": parts}]
    ref = hf_qwen2_vl_generate(tiny_qwen2_vl_dir, messages, images, 1, videos=[video])
    processor = _processor(tiny_qwen2_vl_dir)
    tokenizer = processor.info.ctx.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    ours = processor.apply(prompt, {"image": images, "video": [video]})
    assert ours.prompt_token_ids == ref["prompt_token_ids"]
    model, _ = load_hf_qwen2_vl(tiny_qwen2_vl_dir)
    inputs = ref["inputs"]
    positions, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"],
    )
    assert np.array_equal(ours.family_state.table, positions[:, 0].numpy())
    assert ours.family_state.delta == int(delta) < 0


def test_text_resumes_after_the_largest_position():
    """A video with more frame pairs (5) than merged rows/cols (1x2): text after it resumes at
    start + 5, one past its last temporal position (transformers 5.24 would resume at + 2)."""
    from vlmd.types import MultiModalItem

    item = MultiModalItem("video", "id", offset=2, length=10)
    positions, delta = mrope_positions(14, [item], [(5, 2, 4)], merge_size=2)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[0, 2:12].tolist() == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert positions[1, 2:12].tolist() == [2] * 10
    assert positions[2, 2:12].tolist() == [2, 3] * 5
    assert positions[:, 12:].tolist() == [[7, 8]] * 3
    assert delta == 9 - 14


def test_mrope_tables_equal_transformers(tiny_qwen2_vl_dir):
    config = AutoConfig.from_pretrained(tiny_qwen2_vl_dir).text_config
    theta, scaling = rope_parameters(config)
    ours = MRotaryEmbedding(16, config.max_position_embeddings, theta, scaling, mrope_section(config))
    positions = torch.randint(0, config.max_position_embeddings, (3, 300), generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen2VLRotaryEmbedding(config)(torch.zeros(1), positions[:, None, :])
    our_cos, our_sin = ours.cos_sin(positions, torch.float32)
    assert torch.equal(our_cos[:, 0], cos[0]) and torch.equal(our_sin[:, 0], sin[0])
    plain_cos, _ = ours.cos_sin(positions[0], torch.float32)
    assert torch.equal(plain_cos, ours.cos_sin(positions[0].expand(3, -1), torch.float32)[0])


def test_processor_kwargs_rules(tiny_qwen2_vl_dir):
    processor = _processor(tiny_qwen2_vl_dir)
    image = random_image(5, 640, 480)
    assert len(processor.process_item("image", image, {"max_pixels": 16 * 784}).replacement) == 12
    for kwargs, message in [
        ({"max_pixels": 129 * 784}, "exceeds this server's image limit"),
        ({"fps": 2}, "unknown mm_processor_kwargs"),
        ({"max_pixels": "1000"}, "positive integer"),
        ({"min_pixels": 64 * 784, "max_pixels": 32 * 784}, "larger than max_pixels"),
    ]:
        with pytest.raises(BadRequestError, match=message):
            processor.process_item("image", image, kwargs)
    # Server-wide kwargs move the ceiling (and the identifier covers the merged kwargs).
    raised = _processor(tiny_qwen2_vl_dir, max_pixels=256 * 784)
    assert len(raised.apply([raised.info.marker_token_id("image")], {"image": [image]}).prompt_token_ids) == 13 * 18  # > 128
    assert raised.identifier("image", image, {"max_pixels": 256 * 784}) != processor.identifier("image", image, {})


def test_tiny_checkpoint_loads_offline_with_every_weight(tiny_qwen2_vl_dir, tmp_path):
    import json

    from safetensors import safe_open
    from transformers import Qwen2VLForConditionalGeneration

    from vlmd.testing.tiny import build_tiny

    _, info = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl_dir, output_loading_info=True)
    assert not any(info.values()), info
    summary = json.loads((tiny_qwen2_vl_dir / "vlmd_tiny.json").read_text())
    special = [summary[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id", "pad_token_id")]
    with safe_open(tiny_qwen2_vl_dir / "model.safetensors", "pt") as weights:
        lm_head = weights.get_tensor("lm_head.weight")
    assert not lm_head[special + summary["eos_token_ids"]].any() and lm_head[:100].abs().sum() > 0
    again = build_tiny("qwen2_vl", tmp_path / "again", seed=0)
    for path in tiny_qwen2_vl_dir.iterdir():
        assert (again / path.name).read_bytes() == path.read_bytes(), path.name


def test_dummy_items_are_the_largest(tiny_qwen2_vl_dir):
    processor = _processor(tiny_qwen2_vl_dir)
    dummy = Qwen2VLDummyInputsBuilder(processor.info)
    assert len(processor.process_item("image", dummy.dummy_item("image"), {}).replacement) == 128
    assert len(processor.process_item("video", dummy.dummy_item("video"), {}).replacement) == 16 * 64
