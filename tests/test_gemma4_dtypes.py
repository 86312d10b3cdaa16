"""Gemma 4's vision output in float16 and bfloat16 is the image, not padding (vLLM #40290).

The failure elsewhere: the large checkpoints' vision tower ends in a standardization whose
``std_bias`` (|b| up to ~5e4-1e5) cancels pooled features of the same size; in float16 the
pooled features x sqrt(hidden) or ``std_bias`` itself pass 65504, the image rows turn
infinite, then NaN, and the model answers ``<pad>``. The tiny checkpoint's activations are
small, so the test serves a variant built from it whose tower carries that scale (``loud_tower``):
every patch's embedding is 1000x the tiny's plus a per-channel offset near 1.4e4 (fits
float16), so pooled x sqrt(32) is near 8e4 (does not), and ``std_bias`` / ``std_scale`` undo
both. transformers' own tower cast whole to float16 gives no finite output on it (the test
shows it); vlmd keeps the standardization in float32 (docs/decisions.md D114).

For each of ``--dtype float16`` and ``--dtype bfloat16`` (both accepted on the CPU): an
encoder-only server's image rows are finite, not all equal, not zero, near transformers'
float32 rows and unlike a blank image's; a chat server's answer to the image is not pad
tokens and differs from its answers to a blank image and to no image.
"""

from __future__ import annotations

import json
import shutil
import urllib.request

import numpy as np
import orjson
import pytest
from PIL import Image

from conftest import Server, image_data_url, random_image

SCALE, OFFSET = 1000.0, 1.4e4
# Each image row against transformers' float32 row (measured: float16 > 0.99, bfloat16 0.95).
MIN_COSINE = {"float16": 0.99, "bfloat16": 0.9}
IMAGE = random_image(5, 96, 72)
BLANK = Image.new("RGB", (96, 72), (128, 128, 128))


def loud_tower(tiny_dir, out):
    """The tiny checkpoint with the tower's activations at the large checkpoints' scale
    (module docstring): the standardized output is about the tiny's, the values before it
    are not."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, out)
    weights = load_file(out / "model.safetensors")
    prefix = "model.vision_tower."
    hidden = weights[prefix + "std_bias"].shape[0]
    offset = OFFSET * (1 + 0.05 * torch.randn(hidden, generator=torch.Generator().manual_seed(0)))
    weights[prefix + "patch_embedder.input_proj.weight"] *= SCALE
    table = weights[prefix + "patch_embedder.position_embedding_table"]
    weights[prefix + "patch_embedder.position_embedding_table"] = table * SCALE + offset / 2  # x and y rows add up
    weights[prefix + "std_bias"] = offset * hidden ** 0.5 + weights[prefix + "std_bias"] * SCALE
    weights[prefix + "std_scale"] = weights[prefix + "std_scale"] / SCALE
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def loud_dir(tiny_gemma4_dir, tmp_path_factory):
    return loud_tower(tiny_gemma4_dir, tmp_path_factory.mktemp("gemma4-loud") / "model")


def hf_image_rows(model_dir, image, dtype):
    """transformers' tower and embedder on ``image`` (its PIL processor), cast whole to ``dtype``."""
    import torch
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    settings = json.loads((model_dir / "preprocessor_config.json").read_text())
    processor = Gemma4ImageProcessorPil(patch_size=settings["patch_size"], max_soft_tokens=settings["max_soft_tokens"],
                                        pooling_kernel_size=settings["pooling_kernel_size"])
    pixels = processor(images=[image], return_tensors="pt")
    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(dtype).eval()
    with torch.inference_mode():
        features = model.model.get_image_features(pixels["pixel_values"].to(dtype), pixels["image_position_ids"],
                                                  return_dict=True).pooler_output
    return torch.cat(list(features)).float()


@pytest.fixture(scope="module")
def float32_rows(loud_dir):
    import torch

    return {"image": hf_image_rows(loud_dir, IMAGE, torch.float32), "blank": hf_image_rows(loud_dir, BLANK, torch.float32)}


def test_the_loud_tower_overflows_float16_computed_naively(loud_dir, float32_rows):
    """The variant reproduces the peers' failure: transformers' tower and buffers cast whole to
    float16 give non-finite image rows; in float32 they are the image's (not the blank's)."""
    import torch

    naive = hf_image_rows(loud_dir, IMAGE, torch.float16)
    assert not torch.isfinite(naive).all()
    image, blank = float32_rows["image"], float32_rows["blank"]
    assert torch.isfinite(image).all() and (image - blank).abs().max() > 0.1


def _encoder_rows(server, image):
    import torch
    from safetensors.torch import load as load_safetensors

    body = {"model": "tiny", "items": [{"type": "image_url", "image_url": {"url": image_data_url(image)}}]}
    request = urllib.request.Request(server.url + "/v1/encoder_outputs", data=orjson.dumps(body), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        (rows,) = load_safetensors(response.read()).values()
    return rows, rows.to(torch.float32)


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def servers(request, loud_dir, tmp_path_factory):
    """(dtype, encoder-only server, chat server) over the loud variant in ``dtype``."""
    flags = ("--dtype", request.param, "--max-model-len", "512", "--limit-mm-per-prompt", "image=1,video=0")
    logs = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    encoder = Server(loud_dir, *flags, "--encoder-only", log_dir=logs)
    try:
        chat = Server(loud_dir, *flags, log_dir=logs)
    except BaseException:
        encoder.stop()
        raise
    yield request.param, encoder, chat
    chat.stop()
    encoder.stop()


def test_image_rows_are_finite_and_the_image(servers, float32_rows):
    import torch

    dtype, encoder, _ = servers
    wire, rows = _encoder_rows(encoder, IMAGE)
    assert str(wire.dtype) == f"torch.{dtype}"  # the tower's output in the server's dtype
    _, blank = _encoder_rows(encoder, BLANK)
    reference = float32_rows["image"]
    assert rows.shape == reference.shape
    assert torch.isfinite(rows).all() and rows.abs().max() > 0
    assert (rows - rows[0]).abs().max() > 0.1 and (rows - rows.mean(-1, keepdim=True)).abs().max() > 0.1  # not all equal
    # bfloat16 keeps 8 bits of the tower's residual, where the variant's offset of 1.4e4 leaves
    # steps of 64 over an image signal of ~1e3: its rows are the image's, less closely.
    cosine = torch.nn.functional.cosine_similarity(rows, reference, dim=-1)
    assert cosine.min() > MIN_COSINE[dtype], (dtype, cosine.min(), cosine.mean())
    assert (rows - blank).abs().max() > 0.1


def _answer(server, *images):
    content = [{"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "Describe the image."}]}],
            "max_tokens": 8, "temperature": 0, "return_token_ids": True, "logprobs": True}
    status, answer = server.chat(body)
    assert status == 200, answer
    return answer


def test_the_answer_reads_the_image(servers, loud_dir):
    _, _, chat = servers
    pad = json.loads((loud_dir / "vlmd_tiny.json").read_text())["pad_token_id"]
    answers = {name: _answer(chat, *images) for name, images in (("image", [IMAGE]), ("blank", [BLANK]), ("none", []))}
    tokens = {name: answer["choices"][0]["token_ids"] for name, answer in answers.items()}
    assert set(tokens["image"]) != {pad} and len(tokens["image"]) > 3
    assert tokens["image"] != tokens["blank"] and tokens["image"] != tokens["none"]
    logprobs = [entry["logprob"] for entry in answers["image"]["choices"][0]["logprobs"]["content"]]
    assert np.isfinite(logprobs).all()
