"""Gemma 4 video through the real server: greedy tokens equal transformers' generate.

A video part's frames are sampled as ``Gemma4VideoProcessor`` samples them (the server's
``--media-io-kwargs`` num_frames, here 4, ``i * total // 4``), each resized at the video budget
(70 soft tokens; the tiny's 4-px patches pooled 3 x 3) and written into the prompt under its
``mm:ss`` time (``vlmd_gemma4/video.py``). The reference is transformers' own video processor
with torchvision's resize and normalize stood in (``gemma4_video_oracle.py`` says how and
why), its prompt expansion and ``Gemma4ForConditionalGeneration.generate``. The server runs
48 tokens a step, so a video's span (four frames of 63 soft tokens and the timestamps between
them) is computed over several steps, cut inside frames and inside the text between them.
Unit tests hold the pieces to transformers' own: the sampler, the timestamps and prompt text,
the frame pixels.
"""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import Server, image_data_url, make_video, random_image, video_data_url
from gemma4_oracle import hf_gemma4_generate
from gemma4_video_oracle import hf_gemma4_video_generate, video_processor, video_replacements
from oracle import assert_chat_parity

NUM_FRAMES = 4
MEDIA_IO = json.dumps({"video": {"num_frames": NUM_FRAMES}})


def decoded_video(frames: int, width: int, height: int, fps: int, seed: int) -> dict:
    """A video part: its bytes, and every frame from an independent PyAV decode with the
    ``VideoMetadata`` transformers samples them by."""
    import av

    data = make_video(frames, width, height, fps=fps, seed=seed)
    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return {"media": np.stack(decoded), "metadata": {"total_num_frames": len(decoded), "fps": rate},
            "url": video_data_url(data)}


# 12 frames at 2 fps: frames 0, 3, 6, 9 at 00:00, 00:01, 00:03, 00:04; 112x84 resized to 108x84
# (63 tokens a frame). 3 frames of 64x96 at 3 fps: all three kept (fewer than 4), each resized up to
# 72x120 (60 tokens).
VIDEO = decoded_video(12, 112, 84, fps=2, seed=7)
SHORT_VIDEO = decoded_video(3, 64, 96, fps=3, seed=8)

# name -> (video, the user's text, max_tokens)
CASES = {
    "video": (VIDEO, "What happens in the video?", 10),
    "short_video": (SHORT_VIDEO, "Describe the video.", 8),
}


def _body(video, text, max_tokens):
    content = [{"type": "video_url", "video_url": {"url": video["url"]}}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "logprobs": True}


def _reference(model_dir, video, text, max_tokens):
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": text}]}]
    frames = min(NUM_FRAMES, video["metadata"]["total_num_frames"])  # transformers refuses more than the video has
    return hf_gemma4_video_generate(model_dir, messages, [video["media"]], [video["metadata"]], frames, max_tokens)


IMAGE = random_image(1, 80, 70)
IMAGE_BODY = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(IMAGE)}},
                                                       {"type": "text", "text": "Describe the image."}]}],
              "max_tokens": 8, "temperature": 0, "return_token_ids": True, "logprobs": True}


@pytest.fixture(scope="module")
def references(tiny_gemma4_dir):
    refs = {name: _reference(tiny_gemma4_dir, *case) for name, case in CASES.items()}
    refs["image"] = hf_gemma4_generate(tiny_gemma4_dir, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe the image."}]}], [IMAGE], 8)
    return refs


@pytest.fixture(scope="module")
def server(tiny_gemma4_dir, tmp_path_factory):
    server = Server(tiny_gemma4_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=1,video=1",
                    "--media-io-kwargs", MEDIA_IO, "--max-num-batched-tokens", "48",
                    log_dir=tmp_path_factory.mktemp("gemma4-video-logs"))
    yield server
    server.stop()


def test_the_videos_are_what_the_cases_say(references, tiny_gemma4_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma4_dir)
    text = tokenizer.decode(references["video"]["prompt_token_ids"])
    for stamp in ("00:00 <|image>", "<image|> 00:01 <|image>", "<image|> 00:03 <|image>", "<image|> 00:04 <|image>"):
        assert stamp in text
    video_id = tokenizer.convert_tokens_to_ids("<|video|>")
    assert references["video"]["prompt_token_ids"].count(video_id) == 4 * 63
    assert references["short_video"]["prompt_token_ids"].count(video_id) == 3 * 60
    assert all(len(ref["output_token_ids"]) > 3 for ref in references.values())


@pytest.mark.parametrize("name", list(CASES))
def test_parity_one_request(server, references, name):
    status, body = server.chat(_body(*CASES[name]))
    assert status == 200, body
    assert_chat_parity(body, references[name])


def test_parity_concurrently_with_an_image(server, references):
    bodies = [_body(*case) for case in CASES.values()] * 2 + [IMAGE_BODY]
    names = list(CASES) * 2 + ["image"]

    def one(body):
        status, answer = server.chat(body)
        assert status == 200, answer
        return answer

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(one, bodies))
    for name, answer in zip(names, answers):
        assert_chat_parity(answer, references[name])


def test_cost_counts_the_servers_video_prompt(tiny_gemma4_dir, references):
    from vlmd.cost import CostOptions, compute_cost, parse_video

    video, text, _ = CASES["video"]
    report = compute_cost(str(tiny_gemma4_dir), [parse_video("12x112x84", fps=2)],
                          CostOptions(prompt=text, media_io_kwargs={"video": {"num_frames": NUM_FRAMES}},
                                      max_model_len=1024))
    assert report["prompt_tokens"] == len(references["video"]["prompt_token_ids"])
    assert report["items"][0]["layout"]["timestamps"] == ["00:00", "00:01", "00:03", "00:04"]
    assert report["items"][0]["layout"]["tokens_per_frame"] == 63


def test_bad_video_input_is_a_400(server):
    two = _body(VIDEO, "Two videos.", 2)
    two["messages"][0]["content"].insert(0, two["messages"][0]["content"][0])
    status, body = server.chat(two)
    assert status == 400 and "video" in body["error"]["message"], body
    status, body = server.chat(_body({"url": "data:video/mp4;base64,AAAA"}, "Broken.", 2))
    assert status == 400, body


# ---- the pieces, against transformers' own ---------------------------------------------


@pytest.mark.parametrize("total,source_fps,num_frames,fps", [
    (12, 2.0, 4, None), (100, 30.0, 32, None), (33, 24.0, 32, None), (7, 24.0, 7, None),
    (300, 30.0, 32, 1.0), (300, 30.0, 8, 2.0), (10, None, 32, 0.5), (61, 25.0, 16, 3.0),
])
def test_frame_sampling_equals_transformers(total, source_fps, num_frames, fps):
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    from vlmd_gemma4.video import sample_frame_indices

    ours = sample_frame_indices(total, source_fps, num_frames, fps)
    metadata = VideoMetadata(total_num_frames=total, fps=source_fps or 24)
    if fps is None:
        theirs = default_sample_indices_fn(metadata, num_frames=num_frames)
    else:  # transformers takes fps or num_frames; the server bounds an fps count by num_frames
        by_rate = max(1, int(total / (source_fps or 24) * fps))
        theirs = default_sample_indices_fn(metadata, num_frames=min(by_rate, num_frames))
    assert ours == theirs.tolist()


def test_fewer_frames_than_num_frames_keeps_them_all():
    from vlmd_gemma4.video import sample_frame_indices

    assert sample_frame_indices(3, 24.0, 32, None) == [0, 1, 2]  # transformers raises here


@pytest.mark.parametrize("times", [
    (0.0, 1.5, 3.0, 4.5), (0.0, 0.66, 1.99), (59.5, 60.0, 61.9, 119.999), (3599.0, 3600.0, 3725.5),
])
def test_timestamps_and_prompt_text_equal_transformers(tiny_gemma4_dir, times):
    """The replacement text, and its ids as the server builds them, against
    ``Gemma4Processor.replace_video_token`` for the same frame times (frames at index =
    time x rate of a 1000 fps source, so the times are exact)."""
    from transformers import AutoTokenizer
    from transformers.video_utils import VideoMetadata

    from vlmd_gemma4.video import frame_layout, replacement_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma4_dir)
    indices = [round(time * 1000) for time in times]
    metadata = VideoMetadata(total_num_frames=indices[-1] + 1, fps=1000.0, frames_indices=indices)
    [theirs] = video_replacements(tokenizer, {"num_soft_tokens_per_video": [5], "video_metadata": [metadata]})
    seconds = [index / 1000.0 for index in indices]
    assert replacement_text(seconds, 5, tokenizer.boi_token, tokenizer.eoi_token, "<|video|>") == theirs
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|image>", "<image|>", "<|video|>")}
    layout = frame_layout(lambda text: tokenizer.encode(text, add_special_tokens=False), seconds, 5,
                          ids["<|image>"], ids["<image|>"], ids["<|video|>"])
    assert layout.replacement == tokenizer.encode(theirs, add_special_tokens=False)
    assert [layout.replacement[layout.span_start + start] for start in layout.frame_starts] == [ids["<|video|>"]] * len(times)
    assert layout.replacement[layout.span_start + layout.span_length - 1] == ids["<|video|>"]
    assert layout.replacement[layout.span_start + layout.span_length] == ids["<image|>"]


@pytest.mark.parametrize("video", [VIDEO, SHORT_VIDEO], ids=["resized", "short"])
def test_frame_pixels_equal_transformers(tiny_gemma4_dir, video):
    """Our frames (sampled, resized, rescaled, patchified) are transformers' pixel values,
    bit for bit, and as many soft tokens a frame."""
    import torch

    from vlmd_gemma4.model import patches_of
    from vlmd_gemma4.video import read_video_settings, resize_frames, sample_frame_indices

    total = video["metadata"]["total_num_frames"]
    processor = video_processor(tiny_gemma4_dir, min(NUM_FRAMES, total))
    theirs = processor(videos=[video["media"]], video_metadata=[video["metadata"]], return_tensors="pt",
                       return_metadata=True)
    from transformers import AutoConfig

    settings = read_video_settings(str(tiny_gemma4_dir), AutoConfig.from_pretrained(tiny_gemma4_dir).vision_config)
    indices = sample_frame_indices(total, video["metadata"]["fps"], NUM_FRAMES, None)
    assert indices == theirs["video_metadata"][0].frames_indices.tolist()
    height, width = settings.frame.resized(*video["media"].shape[1:3])
    frames = resize_frames(video["media"][indices], height, width)
    for frame, pixels, positions in zip(frames, theirs["pixel_values_videos"], theirs["video_position_ids"]):
        ours, our_positions = patches_of(torch.from_numpy(frame), settings.frame.patch_size)
        real = (positions != -1).all(-1)
        assert torch.equal(pixels[real], ours) and torch.equal(positions[real], our_positions)
    assert theirs["num_soft_tokens_per_video"][0] == settings.frame.soft_tokens(*video["media"].shape[1:3])


def test_frames_attend_both_ways_where_images_do(tiny_gemma4_dir, references, tmp_path):
    """With ``use_bidirectional_attention="vision"`` each frame's soft tokens see each other
    both ways on the sliding layers (transformers' blocks of type-2 tokens, cut by the
    brackets and timestamps between frames), not the whole video: the answer differs from the
    causal one and equals transformers'."""
    import shutil

    model_dir = tmp_path / "bidirectional"
    shutil.copytree(tiny_gemma4_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = "vision"
    (model_dir / "config.json").write_text(json.dumps(config))
    ref = _reference(model_dir, *CASES["video"])
    assert ref["output_token_ids"] != references["video"]["output_token_ids"]
    server = Server(model_dir, "--max-model-len", "1024", "--limit-mm-per-prompt", "image=0,video=1",
                    "--media-io-kwargs", MEDIA_IO, log_dir=tmp_path)
    try:
        status, body = server.chat(_body(*CASES["video"]))
        assert status == 200, body
        assert_chat_parity(body, ref)
    finally:
        server.stop()
