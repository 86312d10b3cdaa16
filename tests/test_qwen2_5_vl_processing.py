"""Qwen2.5-VL processing against transformers, without a server: token counts (processor,
``vlmd cost``) for images of many sizes and videos of several lengths, pixels, the video's
absolute time (``second_per_grid_ts``) and M-RoPE positions, the windowed vision tower and
the checkpoint.

Where transformers 5.25 and the original Qwen2.5-VL rule disagree (text after a video whose
time span exceeds its merged height and width: 5.25 resumes it at ``start + max(h, w)``, the
original and vLLM one past the video's largest position) vlmd keeps the original rule, as it
does for Qwen2-VL (``vlmd_qwen2_vl/positions.py``); ``test_text_resumes_after_the_video_time``
pins that case, every other case is compared with transformers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from conftest import random_image
from oracle_qwen2_5_vl import hf_qwen2_5_vl_generate, load_hf_qwen2_5_vl
from qwen2_5_vl_support import KEPT_FRAMES, sampled_video, video_bytes
from vlmd.cost import CostOptions, compute_cost, parse_image, parse_video
from vlmd.errors import BadRequestError
from vlmd.media.image import to_rgb
from vlmd.media.video import VideoFrames
from vlmd.processing.base import ItemSize, ProcessingContext
from vlmd.types import MultiModalItem
from vlmd_qwen2_5_vl.processing import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLProcessingInfo,
    Qwen2_5_VLProcessor,
)
from vlmd_qwen2_vl.model import patchify

IMAGE_SIZES = [(57, 1900), (1900, 57), (1024, 1024), (4000, 3000), (640, 480), (33, 50), (3000, 17), (641, 479),
               (28, 28), (2, 300)]


def _processor(model_dir, **server_kwargs) -> Qwen2_5_VLProcessor:
    ctx = ProcessingContext(str(model_dir), "tiny", AutoConfig.from_pretrained(model_dir),
                            AutoTokenizer.from_pretrained(model_dir), mm_processor_kwargs=server_kwargs)
    return Qwen2_5_VLProcessor(Qwen2_5_VLProcessingInfo(ctx))


@pytest.mark.parametrize("max_pixels", [None, 16 * 28 * 28, 1280 * 28 * 28])
def test_image_token_counts_equal_transformers(tiny_qwen2_5_vl_dir, max_pixels):
    _, hf = load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    kwargs = {} if max_pixels is None else {"max_pixels": max_pixels}
    info = _processor(tiny_qwen2_5_vl_dir, **kwargs).info
    size = {"shortest_edge": hf.image_processor.size.shortest_edge,
            "longest_edge": max_pixels or hf.image_processor.size.longest_edge}
    theirs = hf._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in IMAGE_SIZES],
                                           images_kwargs={"size": size})["num_image_tokens"]
    ours = [info.item_tokens("image", ItemSize(w, h), kwargs).replacement for w, h in IMAGE_SIZES]
    assert ours == theirs
    limit = 128 if max_pixels is None else max_pixels // 784
    assert limit // 2 < ours[3] <= limit  # 4000x3000 is shrunk to the limit


def test_cost_and_prompt_lengths_equal_transformers(tiny_qwen2_5_vl_dir):
    """``vlmd cost`` for images and videos of several lengths equals the length of
    transformers' processed prompt for the same items (a video: the frames the decoder keeps,
    at most ``num_frames`` and an even count, a lone frame aside)."""
    _, hf = load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    for width, height in [(57, 1900), (1024, 1024)]:
        report = compute_cost(str(tiny_qwen2_5_vl_dir), [parse_image(f"{width}x{height}")],
                              CostOptions(prompt="What is here?"))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is here?"}]}]
        prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image = random_image(1, width, height)
        assert report["prompt_tokens"] == len(hf(text=prompt, images=[image])["input_ids"][0])
    # (the --video spec, its frame rate, --media-io-kwargs video, frames kept): by count, and
    # by rate (2 s at 8 fps sampled at 2 fps: 4 frames; 20 s: the num_frames bound).
    for spec, fps, media_io, kept in [("1x200x150", 4, {"num_frames": 8}, 1), ("5x200x150", 4, {"num_frames": 8}, 4),
                                      ("40x200x150", 4, {"num_frames": 8}, 8),
                                      ("2sx200x150", 8, {"num_frames": 8, "fps": 2}, 4),
                                      ("20sx200x150", 8, {"num_frames": 8, "fps": 2}, 8)]:
        video = np.stack([np.asarray(random_image(seed, 200, 150)) for seed in range(kept)])
        report = compute_cost(str(tiny_qwen2_5_vl_dir), [parse_video(spec, fps=fps)],
                              CostOptions(prompt="What happens?", media_io_kwargs={"video": media_io}))
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
        prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert report["items"][0]["frames"] == kept
        assert report["prompt_tokens"] == len(hf(text=prompt, videos=[video])["input_ids"][0]), spec


@pytest.mark.parametrize("size", [(640, 480), (57, 1900), (300, 200)])
def test_image_pixels_equal_transformers(tiny_qwen2_5_vl_dir, size):
    image = random_image(3, *size)
    _, hf = load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    reference = hf.image_processor(image, return_tensors="pt")
    processor = _processor(tiny_qwen2_5_vl_dir)
    item = processor.process_item("image", to_rgb(image), {})
    settings = processor.info.settings["image"]
    ours = patchify(torch.from_numpy(item.encoder_inputs["pixels"]), torch.tensor(settings.mean),
                    torch.tensor(settings.std), settings)
    assert [list(item.encoder_inputs["grid_thw"])] == reference["image_grid_thw"].tolist()
    assert torch.equal(ours, reference["pixel_values"])


def _prompt(processor, messages):
    tokenizer = processor.info.ctx.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_video_time_and_positions_equal_transformers(tiny_qwen2_5_vl_dir):
    frames, metadata = sampled_video(video_bytes())
    sampled_fps = len(metadata["frames_indices"]) / metadata["total_num_frames"] * metadata["fps"]
    video = VideoFrames.of(frames, sampled_fps)
    images = [random_image(3, 640, 480), random_image(4, 96, 300)]
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}, {"type": "image"},
             {"type": "text", "text": "What changed?"}]
    messages = [{"role": "user", "content": parts}]
    ref = hf_qwen2_5_vl_generate(tiny_qwen2_5_vl_dir, messages, images, 1, videos=[frames],
                                 video_metadata=[metadata])
    processor = _processor(tiny_qwen2_5_vl_dir)
    ours = processor.apply(_prompt(processor, messages), {"image": images, "video": [video]})
    assert ours.prompt_token_ids == ref["prompt_token_ids"]
    video_item = next(item for item in ours.items if item.modality == "video")
    assert [video_item.encoder_inputs["second_per_grid_t"]] == ref["second_per_grid_ts"] == [1.0]
    model, _ = load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    inputs = ref["inputs"]
    positions, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"], second_per_grid_ts=inputs["second_per_grid_ts"],
    )
    assert np.array_equal(ours.family_state.table, positions[:, 0].numpy())
    assert ours.family_state.delta == int(delta)
    # The time row moves by 2 per frame pair (1 s at 2 tokens per second), not Qwen2-VL's 1.
    table = ours.family_state.table
    video_times = sorted(set(table[0, video_item.offset : video_item.end].tolist()))
    assert np.diff(video_times).tolist() == [2] * (len(video_times) - 1) and len(video_times) == KEPT_FRAMES // 2


def test_frames_without_a_rate_count_as_24_fps(tiny_qwen2_5_vl_dir):
    """As transformers' default VideoMetadata for bare frames; and the rate is part of the
    item's identity (the same frames at another rate take other positions)."""
    frames = np.stack([np.asarray(random_image(seed, 112, 84)) for seed in range(4)])
    processor = _processor(tiny_qwen2_5_vl_dir)
    assert processor.process_item("video", frames, {}).encoder_inputs["second_per_grid_t"] == 2 / 24
    ref = hf_qwen2_5_vl_generate(tiny_qwen2_5_vl_dir, [{"role": "user", "content": [{"type": "video"}]}], [], 1,
                                 videos=[frames])
    assert ref["second_per_grid_ts"] == [pytest.approx(2 / 24)]
    assert processor.identifier("video", frames, {}) != processor.identifier("video", VideoFrames.of(frames, 2.0), {})


def test_text_resumes_after_the_video_time():
    """4 frame pairs 2 time positions apart on a 1x2 merged grid: text resumes one past the
    last time position (start + 7), the original Qwen2.5-VL rule."""
    from vlmd_qwen2_vl.positions import mrope_positions

    item = MultiModalItem("video", "id", offset=2, length=8)
    positions, delta = mrope_positions(12, [item], [(4, 2, 4)], merge_size=2, time_intervals=[2.0])
    assert positions[0, 2:10].tolist() == [2, 2, 4, 4, 6, 6, 8, 8]
    assert positions[:, 10:].tolist() == [[9, 10]] * 3
    assert delta == 11 - 12


def test_windowed_tower_equals_transformers(tiny_qwen2_5_vl_dir):
    """Our model's tower, loaded through vlmd's loader, on our pixels, equals transformers'
    image features; the image spans several attention windows."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import get_vision_window_index

    from vlmd_qwen2_5_vl.model import Qwen2_5_VLModel

    config = AutoConfig.from_pretrained(tiny_qwen2_5_vl_dir)
    ours = Qwen2_5_VLModel.load(tiny_qwen2_5_vl_dir, config, torch.float32)
    processor = _processor(tiny_qwen2_5_vl_dir)
    image = random_image(5, 640, 480)
    item = processor.process_item("image", image, {})
    grid = torch.tensor([list(item.encoder_inputs["grid_thw"])])
    _, cu_window_seqlens = get_vision_window_index(grid, spatial_merge_size=2, window_size=56, patch_size=14)
    assert len(torch.unique_consecutive(torch.as_tensor(cu_window_seqlens))) - 1 > 4
    with torch.inference_mode():
        features = ours.embed_multimodal("image", [item.encoder_inputs])[0]
        model, hf = load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
        reference = hf.image_processor(image, return_tensors="pt")
        expected = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    expected = torch.cat(list(expected.pooler_output))
    assert torch.allclose(features, expected, atol=1e-5), (features - expected).abs().max()


def test_processor_kwargs_rules(tiny_qwen2_5_vl_dir):
    processor = _processor(tiny_qwen2_5_vl_dir)
    image = random_image(5, 640, 480)
    assert len(processor.process_item("image", image, {"max_pixels": 16 * 784}).replacement) == 12
    for kwargs, message in [
        ({"max_pixels": 129 * 784}, "exceeds this server's image limit"),
        ({"fps": 2}, "unknown mm_processor_kwargs"),
        ({"min_pixels": 64 * 784, "max_pixels": 32 * 784}, "larger than max_pixels"),
    ]:
        with pytest.raises(BadRequestError, match=message):
            processor.process_item("image", image, kwargs)
    # Server-wide kwargs move the ceiling.
    raised = _processor(tiny_qwen2_5_vl_dir, max_pixels=256 * 784)
    marker = raised.info.marker_token_id("image")
    assert len(raised.apply([marker], {"image": [image]}).prompt_token_ids) == 13 * 18  # > 128


def test_dummy_items_are_the_largest(tiny_qwen2_5_vl_dir):
    processor = _processor(tiny_qwen2_5_vl_dir)
    dummy = Qwen2_5_VLDummyInputsBuilder(processor.info)
    assert len(processor.process_item("image", dummy.dummy_item("image"), {}).replacement) == 128
    assert len(processor.process_item("video", dummy.dummy_item("video"), {}).replacement) == 16 * 64


def test_tiny_checkpoint_loads_offline_with_every_weight(tiny_qwen2_5_vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    _, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_qwen2_5_vl_dir, output_loading_info=True)
    assert not any(info.values()), info
    vision = AutoConfig.from_pretrained(tiny_qwen2_5_vl_dir).vision_config
    assert (vision.window_size, list(vision.fullatt_block_indexes), vision.depth) == (56, [1], 3)


# Indices transformers' Qwen2VLVideoProcessor.sample_frames(metadata, fps=2, max_frames=N)
# returns (transformers 5.19 with torchvision, in the peer's venv: ../shared/peer/README.md;
# torchvision cannot be installed beside this venv's torch): (total, source fps, N) -> indices.
TRANSFORMERS_FPS_SAMPLES = {
    (16, 8.0, 8): [0, 4, 8, 12],
    (12, 4.0, 8): [0, 2, 4, 6, 8, 10],
    (10, 6.0, 8): [0, 2, 5, 7],
    (7, 30.0, 8): [0, 1, 3, 5],
    (300, 30.0, 32): list(range(0, 300, 15)),
    (90, 29.97, 8): [0, 15, 30, 45, 60, 75],
    (45, 10.0, 8): [0, 5, 11, 16, 22, 28, 33, 39],
}


@pytest.mark.parametrize("key", list(TRANSFORMERS_FPS_SAMPLES))
def test_sampling_by_rate_equals_transformers(key):
    from vlmd.media.policy import MediaPolicy
    from vlmd.media.video import frames_to_keep, sample_frame_indices

    total, source_fps, bound = key
    policy = MediaPolicy(video_num_frames=bound, video_fps=2.0)
    count = frames_to_keep(total, source_fps, policy)
    assert sample_frame_indices(total, count) == TRANSFORMERS_FPS_SAMPLES[key]
    # Without a rate (or a source rate), num_frames as before.
    assert frames_to_keep(total, source_fps, MediaPolicy(video_num_frames=bound)) == min(bound, total) // 2 * 2
    assert frames_to_keep(total, None, policy) == min(bound, total) // 2 * 2
    assert frames_to_keep(1, 30.0, policy) == 1


def test_decoded_video_by_rate_carries_its_sampled_fps():
    from conftest import make_video
    from vlmd.media.policy import MediaPolicy
    from vlmd.media.video import decode_video

    video = decode_video(make_video(16, fps=8), MediaPolicy(video_num_frames=8, video_fps=2.0))
    assert video.shape[0] == 4 and video.sampled_fps == pytest.approx(2.0)  # 4 of 16 frames at 8 fps
    assert decode_video(make_video(16, fps=8), MediaPolicy(video_num_frames=8)).sampled_fps == pytest.approx(4.0)
