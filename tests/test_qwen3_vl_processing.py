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


# ---- video ----------------------------------------------------------------------------


def _video(frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def _video_prompt(processor, messages) -> list[int]:
    tokenizer = processor.info.ctx.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)


def test_video_prompt_positions_and_pixels_equal_transformers(tiny_qwen3_vl_dir):
    """An image, then a video of 8 frames decoded from a 7 fps source (every third frame):
    the expanded prompt (timestamps, brackets per frame pair, the template's wrapper gone),
    the M-RoPE table and delta, the grid and the normalised patches equal transformers'."""
    from vlmd.media.video import VideoFrames
    from vlmd_qwen2_vl.model import patchify
    from vlmd_qwen3_vl.settings import read_settings

    from qwen3_vl_oracle import hf_qwen3_vl_inputs

    frames, indices = _video(8, 128, 96), [0, 3, 6, 9, 12, 15, 18, 21]
    video = VideoFrames.of(frames, 8 / 24 * 7.0, indices, 7.0)
    image = random_image(1, 320, 240)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                             {"type": "text", "text": "What happens?"}]}]
    _, ref = hf_qwen3_vl_inputs(tiny_qwen3_vl_dir, messages, [image], [frames],
                                [{"total_num_frames": 24, "fps": 7.0, "frames_indices": indices}])
    processor = _processor(tiny_qwen3_vl_dir)
    output = processor.apply(_video_prompt(processor, messages), {"image": [image], "video": [video]})
    assert output.prompt_token_ids == ref["input_ids"][0].tolist()
    text = processor.info.ctx.tokenizer.decode(output.prompt_token_ids)
    assert "<0.2 seconds><|vision_start|>" in text and "<2.8 seconds><|vision_start|>" in text  # (18 + 21) / 2 / 7
    model, _ = load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    positions, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                                  image_grid_thw=ref["image_grid_thw"],
                                                  video_grid_thw=ref["video_grid_thw"])
    assert np.array_equal(output.family_state.table, positions[:, 0].numpy())
    assert output.family_state.delta == int(delta)
    item = output.items[1]
    assert list(item.encoder_inputs["grid_thw"]) == ref["video_grid_thw"][0].tolist()
    # The span: first pair's first placeholder to the last pair's last, text between included.
    ids = output.prompt_token_ids
    pads = [i for i, token in enumerate(ids) if token == model.config.video_token_id]
    assert (item.offset, item.length) == (pads[0], pads[-1] - pads[0] + 1)
    settings = read_settings(str(tiny_qwen3_vl_dir), "video")
    ours = patchify(torch.from_numpy(item.encoder_inputs["pixels"]), torch.tensor(settings.mean),
                    torch.tensor(settings.std), settings)
    torch.testing.assert_close(ours, ref["pixel_values_videos"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(("frames", "width", "height"), [(2, 64, 64), (4, 128, 96), (5, 96, 64), (20, 128, 96),
                                                         (60, 64, 64)])
def test_video_counts_and_cost_equal_the_processors_count(tiny_qwen3_vl_dir, frames, width, height):
    """Videos of several lengths (an odd one: its last frame repeated), as bare frames (24
    fps) to the processor and as ``vlmd cost --video FRAMESxWxH`` of a 10 fps source, whose
    frames transformers samples at 2 fps (4 of the 5, 12 of the 60): item_tokens, the
    expanded prompt and the cost equal transformers'."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from vlmd.cost import parse_video

    from qwen3_vl_oracle import hf_qwen3_vl_inputs

    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What is here?"}]}]
    processor = _processor(tiny_qwen3_vl_dir)
    video = _video(frames, width, height)
    _, ref = hf_qwen3_vl_inputs(tiny_qwen3_vl_dir, messages, [], [video])
    prompt = _video_prompt(processor, messages)
    output = processor.apply(prompt, {"video": [video]})
    assert output.prompt_token_ids == ref["input_ids"][0].tolist()
    tokens = processor.info.item_tokens("video", ItemSize(width, height, frames), {})
    assert len(prompt) - 1 + tokens.replacement == len(output.prompt_token_ids)
    assert tokens.placeholders == output.items[0].length
    # vlmd cost: the frames transformers keeps of a 10 fps source, at their times.
    _, ref = hf_qwen3_vl_inputs(tiny_qwen3_vl_dir, messages, [], [video], [{"total_num_frames": frames, "fps": 10.0}],
                                sample_fps=2)
    report = compute_cost(str(tiny_qwen3_vl_dir), [parse_video(f"{frames}x{width}x{height}", 10.0)],
                          CostOptions(prompt="What is here?"))
    assert report["prompt_tokens"] == ref["input_ids"].shape[1]
    kept = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=frames, fps=10.0), fps=2)
    assert report["items"][0]["frames"] == len(kept)


@pytest.mark.parametrize(("frames", "height", "width"), [(2, 1900, 57), (8, 1024, 1024), (32, 3000, 4000), (7, 20, 500),
                                                         (64, 480, 640), (3, 33, 50)])
@pytest.mark.parametrize("cap", [None, 768, 4])
def test_video_resize_equals_transformers(frames, height, width, cap):
    """The frame size of a video, with and without the per-frame cap, under the published
    limits and the tiny ones: transformers' own function and token count."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as reference

    from vlmd_qwen3_vl.video import capped_max_pixels, smart_resize

    for low, high in ((4096, 25165824), (8 * 1024, 256 * 1024)):
        max_pixels = capped_max_pixels(frames, low, high, 32, cap)
        ours = smart_resize(frames, height, width, 2, 32, low, max_pixels)
        assert ours == reference(frames, height, width, 2, 32, low, max_pixels)
        processor = Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high},
                                          cap_pixels_per_frame=cap is not None, max_video_tokens=cap)
        patches = processor.get_num_of_video_patches(frames, height, width)
        assert patches == -(-frames // 2) * (ours[0] // 16) * (ours[1] // 16)  # frame pairs x patches


def test_timestamps_equal_transformers():
    """Pair times from frame times, odd counts repeating the last frame, rounded as
    ``Qwen3VLProcessor`` rounds them."""
    from transformers import Qwen3VLProcessor

    from vlmd_qwen3_vl.video import pair_times

    for indices, fps in (([0, 7, 15], 29.97), ([0, 1, 2, 3], 24), (list(range(0, 600, 40)), 30000 / 1001),
                         ([5, 6], 4.0)):
        theirs = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
        ours = pair_times([index / fps for index in indices], 2)
        assert [f"{t:.1f}" for t in ours] == [f"{t:.1f}" for t in theirs] and ours == theirs


def test_video_bad_input_and_identity(tiny_qwen3_vl_dir):
    """One frame is no pair (transformers refuses it too); the same frames at other times
    are another item; a bare marker (warm-up, profile) expands without a wrapper."""
    from vlmd.errors import BadRequestError
    from vlmd.media.video import VideoFrames

    processor = _processor(tiny_qwen3_vl_dir)
    with pytest.raises(BadRequestError, match="at least 2 frames"):
        processor.process_item("video", _video(1, 64, 64), {})
    frames = _video(4, 64, 64)
    assert processor.identifier("video", frames, {}) != processor.identifier(
        "video", VideoFrames.of(frames, 2.0, [0, 2, 4, 6], 4.0), {})
    marker = processor.info.marker_token_id("video")
    output = processor.apply([marker, 7], {"video": [frames]})
    assert len(output.prompt_token_ids) == 1 + len(processor.process_item("video", frames, {}).replacement)


def test_video_dummy_is_the_largest_and_its_rows_interleave_text(tiny_qwen3_vl_dir):
    """The profile's video holds the most placeholders a server video can; the model's rows
    for it put each pair's vision rows where its placeholders are and the text between pairs
    as its own embeddings with zero DeepStack parts."""
    from vlmd_qwen3_vl.model import Qwen3VLModel
    from vlmd_qwen3_vl.processing import Qwen3VLDummyInputsBuilder

    processor = _processor(tiny_qwen3_vl_dir)
    dummy = Qwen3VLDummyInputsBuilder(processor.info).dummy_item("video")
    assert len(dummy) == 32
    processed = processor.process_item("video", dummy, {})
    pairs, per_pair = 16, processed.encoder_inputs["grid_thw"][1] * processed.encoder_inputs["grid_thw"][2] // 4
    assert pairs * per_pair == 256 * 1024 // (2 * 32 * 32)  # all of max_pixels
    config = AutoConfig.from_pretrained(tiny_qwen3_vl_dir)
    model = Qwen3VLModel.load(tiny_qwen3_vl_dir, config, torch.float32)
    frames = _video(4, 64, 64)
    item = processor.process_item("video", frames, {})
    (rows,) = model.embed_multimodal("video", [item.encoder_inputs])
    assert rows.shape == (item.num_placeholders, model.encoder_output_width)
    span = item.replacement[item.placeholder_offset : item.placeholder_offset + item.num_placeholders]
    text = [i for i, token in enumerate(span) if token != config.video_token_id]
    hidden = model.hidden_size
    assert len(text) == len(item.encoder_inputs["between"][0]) and not rows[text, hidden:].any()
    torch.testing.assert_close(rows[text, :hidden], model.embed_input_ids(torch.tensor([span[i] for i in text])))
    assert rows[[i for i in range(len(span)) if i not in text], hidden:].abs().sum(-1).gt(0).all()


def test_decoded_video_carries_its_frame_indices_and_rate():
    """What the timestamps are computed from: the kept frames' source indices and the rate."""
    from conftest import make_video
    from vlmd.media.policy import MediaPolicy
    from vlmd.media.video import decode_video

    video = decode_video(make_video(16, fps=8), MediaPolicy(video_num_frames=8))
    assert video.frame_indices == (0, 2, 4, 6, 8, 10, 12, 14) and video.source_fps == 8.0


@pytest.mark.parametrize(("total", "source_fps", "fps", "num_frames"), [
    (16, 4.0, None, 32), (5, 10.0, None, 32), (60, 10.0, None, 32), (1, 30.0, None, 32), (300, 29.97, None, 1000),
    (90, 30000 / 1001, 1.0, 32), (300, 29.97, None, 32), (7, None, 4.0, 32)])
def test_frame_sampling_equals_transformers(tiny_qwen3_vl_dir, total, source_fps, fps, num_frames):
    """The frames kept of a source video: ``Qwen3VLVideoProcessor.sample_frames`` at the
    server's fps, else the checkpoint's 2 (24 fps for a source that names no rate); the
    server's num_frames bounds the count (the (300, 29.97) video at 32: 32 frames, spread
    the same way, where transformers keeps 40)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from vlmd.media.policy import MediaPolicy

    info = _processor(tiny_qwen3_vl_dir).info
    ours = info.video_frame_indices(total, source_fps, MediaPolicy(video_num_frames=num_frames, video_fps=fps))
    reference = Qwen3VLVideoProcessor()
    theirs = reference.sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps), fps=fps).tolist()
    if len(theirs) <= num_frames:
        assert ours == theirs
    else:
        assert ours == reference.sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps),
                                               num_frames=num_frames).tolist()


def test_decoder_keeps_the_frames_the_family_chooses():
    """An odd count stays odd (the processor pairs the last frame with itself)."""
    from conftest import make_video
    from vlmd.media.policy import MediaPolicy
    from vlmd.media.video import decode_video

    video = decode_video(make_video(10, fps=8), MediaPolicy(video_num_frames=8), choose=lambda total, rate: [0, 4, 9])
    assert video.shape[0] == 3 and video.frame_indices == (0, 4, 9) and video.source_fps == 8.0


@pytest.fixture(scope="module")
def merging_dir(tiny_qwen3_vl_dir, tmp_path_factory):
    """The tiny checkpoint with two BPE merges Qwen's vocabulary has, "Ġ<" and ".<", so text
    ending in a space or a full stop right before a video merges with its first timestamp."""
    import shutil

    out = tmp_path_factory.mktemp("qwen3-vl-merging")
    for path in tiny_qwen3_vl_dir.iterdir():
        shutil.copy(path, out / path.name)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    model = tokenizer["model"]
    # The ids stay as they are: the two lowest-priority merges (whose tokens no merge
    # builds on) become the new ones, their tokens renamed.
    for index, new in zip((-1, -2), (["Ġ", "<"], [".", "<"])):
        old = "".join(model["merges"][index])
        assert not any(old in pair for pair in model["merges"]), old
        model["vocab"]["".join(new)] = model["vocab"].pop(old)
        model["merges"][index] = new
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


@pytest.mark.parametrize("before", ["Look at this ", "Look at this.", "Look:\n"])
def test_first_timestamp_tokenized_with_the_text_before_it(merging_dir, before):
    """transformers tokenizes the expanded prompt whole: text right before a video can merge
    with its first "<"; the prompt ids, the items' offsets and the positions follow."""
    from qwen3_vl_oracle import hf_qwen3_vl_inputs

    frames = _video(4, 64, 64)
    image = random_image(2, 96, 64)
    messages = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": "video"},
                                             {"type": "text", "text": "and " + before}, {"type": "video"},
                                             {"type": "image"}]}]
    _, ref = hf_qwen3_vl_inputs(merging_dir, messages, [image], [frames, frames])
    processor = _processor(merging_dir)
    tokenizer = processor.info.ctx.tokenizer
    merged = before.endswith((" ", "."))
    assert (len(tokenizer.encode(before + "<0.0 seconds>")) < len(tokenizer.encode(before)) + len(
        tokenizer.encode("<0.0 seconds>"))) == merged
    output = processor.apply(_video_prompt(processor, messages), {"video": [frames, frames], "image": [image]})
    assert output.prompt_token_ids == ref["input_ids"][0].tolist()
    for item in output.items:
        marker = processor.info.marker_token_id(item.modality)
        assert output.prompt_token_ids[item.offset] == marker == output.prompt_token_ids[item.offset + item.length - 1]
    model, _ = load_hf_qwen3_vl(merging_dir)
    positions, _ = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                              image_grid_thw=ref["image_grid_thw"], video_grid_thw=ref["video_grid_thw"])
    assert np.array_equal(output.family_state.table, positions[:, 0].numpy())
