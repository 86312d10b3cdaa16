"""Precomputed image embeddings (vLLM's ``image_embeds`` content part): the encoder's own
output sent in place of the image gives the image's greedy tokens without an encoder run;
bad embeddings (shape, dtype, size, values, format) are 400s that say which, and the server
keeps serving; families whose image layout depends on the image refuse them."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import orjson
import pytest
import torch

from conftest import Server, assert_error, image_data_url, random_image
from vlmd.encoder_wire import unpack
from vlmd.errors import BadRequestError
from vlmd.processing.encoder_tensors import from_wire

IMAGE_TOKENS = 576


@pytest.fixture(scope="module")
def encoder_server(tiny_llava_dir, tmp_path_factory):
    """The same checkpoint's encoder alone (``--encoder-only``): what it sends is the
    encoder's output, computed by the same code as the language server's."""
    server = Server(tiny_llava_dir, "--encoder-only", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def encoder_output(server: Server, image) -> torch.Tensor:
    body = {"model": server.model, "items": [{"type": "image_url", "image_url": {"url": image_data_url(image)}}]}
    status, raw = server.request("POST", "/v1/encoder_outputs", orjson.dumps(body))
    assert status == 200, raw[:300]
    _, tensors = unpack(raw)
    (tensor,) = tensors.values()
    return from_wire(tensor)


def saved(value) -> str:
    """``value`` as vLLM's clients send it: base64 of ``torch.save``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def embeds_part(data) -> dict:
    return {"type": "image_embeds", "image_embeds": data}


def ask(server, part, max_tokens: int = 8) -> tuple[int, dict]:
    return server.chat({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True})


def test_the_encoders_output_as_image_embeds_gives_the_images_tokens(llava_server, encoder_server):
    image = random_image(71, 320, 240)
    output = encoder_output(encoder_server, image)
    assert output.shape[0] == IMAGE_TOKENS and output.dtype == torch.float32
    status, by_image = ask(llava_server, {"type": "image_url", "image_url": {"url": image_data_url(image)}})
    assert status == 200, by_image
    before = llava_server.metrics()
    for value in (saved(output), {"image_embeds": saved(output)}, saved(output[None])):  # vLLM's spellings
        status, by_embeds = ask(llava_server, embeds_part(value))
        assert status == 200, by_embeds
        assert by_embeds["choices"][0]["token_ids"] == by_image["choices"][0]["token_ids"]
        assert by_embeds["prompt_token_ids"] == by_image["prompt_token_ids"]
        assert by_embeds["usage"]["prompt_tokens_details"]["image_tokens"] == IMAGE_TOKENS
    after = llava_server.metrics()
    assert after["vlmd_encoder_forwards_total"] == before["vlmd_encoder_forwards_total"]  # never encoded here
    # A half-precision copy is the same vectors rounded: taken, and answered.
    status, body = ask(llava_server, embeds_part(saved(output.to(torch.float16))))
    assert status == 200, body


def test_embeds_by_uuid_and_beside_an_image(llava_server, encoder_server):
    image, other = random_image(72, 96, 96), random_image(73, 96, 96)
    output = encoder_output(encoder_server, image)
    status, first = ask(llava_server, {**embeds_part(saved(output)), "uuid": "embeds-72"})
    assert status == 200, first
    status, again = ask(llava_server, {"type": "image_embeds", "uuid": "embeds-72"})
    assert status == 200, again
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    both = llava_server.chat({"messages": [{"role": "user", "content": [
        embeds_part(saved(output)), {"type": "image_url", "image_url": {"url": image_data_url(other)}},
        {"type": "text", "text": "Compare."}]}], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    images = llava_server.chat({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
        {"type": "image_url", "image_url": {"url": image_data_url(other)}},
        {"type": "text", "text": "Compare."}]}], "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert both[0] == images[0] == 200
    assert both[1]["choices"][0]["token_ids"] == images[1]["choices"][0]["token_ids"]


WIDTH = 64  # the tiny LLaVA's hidden size, checked below


def _archive_without_zip(value) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=False)
    return base64.b64encode(buffer.getvalue()).decode()


class Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def _evil_archive() -> str:
    """A zip archive whose pickle names a callable: torch's restricted unpickler refuses it."""
    buffer = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buffer)
    raw = buffer.getvalue()
    evil = pickle.dumps(Evil(), protocol=2)
    # Same archive layout, the tensor's pickle replaced by one that would call print.
    import zipfile

    source = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for entry in source.infolist():
            data = source.read(entry.filename)
            target.writestr(entry, evil if entry.filename.endswith("data.pkl") else data)
    return base64.b64encode(out.getvalue()).decode()


BAD = {
    "rows": (lambda: saved(torch.zeros(IMAGE_TOKENS - 1, WIDTH)), "hold 575 vectors", "takes 576"),
    "width": (lambda: saved(torch.zeros(IMAGE_TOKENS, WIDTH + 1)), "shape [576, 65]", f"[vectors, {WIDTH}]"),
    "batch of two": (lambda: saved(torch.zeros(2, IMAGE_TOKENS, WIDTH)), "shape [2, 576, 64]"),
    "integers": (lambda: saved(torch.zeros(IMAGE_TOKENS, WIDTH, dtype=torch.int32)), "float32, float16 or bfloat16"),
    "nan": (lambda: saved(torch.full((IMAGE_TOKENS, WIDTH), float("nan"))), "not finite"),
    "inf": (lambda: saved(torch.full((IMAGE_TOKENS, WIDTH), float("inf"))), "not finite"),
    "not base64": (lambda: "not*base64!", "not valid base64"),
    "raw floats": (lambda: base64.b64encode(np.zeros((IMAGE_TOKENS, WIDTH), np.float32).tobytes()).decode(),
                   "saved with torch.save"),
    "legacy pickle": (lambda: _archive_without_zip(torch.zeros(IMAGE_TOKENS, WIDTH)), "saved with torch.save"),
    "code in the pickle": (_evil_archive, "could not be read as a tensor"),
    "a list": (lambda: saved([torch.zeros(IMAGE_TOKENS, WIDTH)]), "one dense tensor"),
    "sparse": (lambda: saved(torch.zeros(IMAGE_TOKENS, WIDTH).to_sparse()), "one dense tensor"),
    "too large": (lambda: base64.b64encode(b"PK\x03\x04" + bytes(2048 * WIDTH * 4 + (64 << 10))).decode(),
                  "image_embeds holds more than", "at most max_model_len (2048) vectors of 64 values"),
    "empty": (lambda: "", "must be a base64 string"),
    "number": (lambda: 7, "must be a base64 string"),
    "other key": (lambda: {"image_grid_thw": saved(torch.tensor([[1, 2, 2]]))}, "takes no 'image_grid_thw'"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_image_embeds_are_400s_that_say_what_is_wrong(llava_server, name):
    make, *fragments = BAD[name]
    status, body = ask(llava_server, embeds_part(make()), max_tokens=2)
    assert_error(status, body, 400, *fragments)
    assert "unpickled!" not in llava_server.log_path.read_text()  # the pickle's call never ran in the server
    status, body = ask(llava_server, {"type": "image_url", "image_url": {"url": image_data_url(random_image(74, 32, 32))}},
                       max_tokens=2)
    assert status == 200, body  # and the server keeps serving


def test_a_precomputed_item_keeps_its_output_when_the_runner_lets_go():
    """The runner stores an item's ``encoder_output`` and sets it to None (it can encode an
    evicted output again from the encoder inputs); an item given as embeddings has none, so
    it keeps its output for a request preempted after an eviction."""
    import dataclasses

    from vlmd.processing.embeds import PrecomputedItem

    vectors = torch.ones(3, WIDTH)
    item = PrecomputedItem(modality="image", identifier="a" * 64, offset=5, length=3, precomputed=vectors)
    output, item.encoder_output = item.encoder_output, None  # what model_runner._run_encoders does
    assert output is vectors and item.encoder_output is vectors
    moved = dataclasses.replace(item, offset=0)  # as a family's apply moves items (Llama 3.2 Vision)
    assert moved.encoder_output is vectors and moved.offset == 0
    # To tensor-parallel ranks on the step channel's typed codec (no pickle): still an item
    # that keeps its output.
    from vlmd.distributed.step_codec import decode, encode

    on_rank = decode(encode([item]))[0]
    assert type(on_rank) is PrecomputedItem and on_rank.encoder_output.equal(vectors)
    _, on_rank.encoder_output = on_rank.encoder_output, None
    assert on_rank.encoder_output.equal(vectors)


def test_the_width_checked_is_the_models(tiny_llava_dir):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_llava_dir).text_config.hidden_size == WIDTH


def test_an_image_embeds_part_without_embeddings_or_uuid_is_a_400(llava_server):
    status, body = ask(llava_server, {"type": "image_embeds"})
    assert_error(status, body, 400, "image_embeds must hold the embeddings")
    status, body = ask(llava_server, {"type": "image_embeds", "uuid": "never-sent-embeds"})
    assert_error(status, body, 400, "uuid 'never-sent-embeds'", "not known")


def _processor(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from vlmd.plugins.manager import build_registry
    from vlmd.processing.base import ProcessingContext

    config = AutoConfig.from_pretrained(model_dir)
    family = build_registry().for_architectures(list(config.architectures))
    ctx = ProcessingContext(model_dir=str(model_dir), model_id="m", hf_config=config,
                            tokenizer=AutoTokenizer.from_pretrained(model_dir))
    return family.load("processor")(family.load("processing_info")(ctx))


def test_families_say_whether_they_take_embeddings(tiny_llava_dir, tiny_qwen2_vl_dir, tiny_mllama_dir):
    llava = _processor(tiny_llava_dir).embeds_template("image", {})
    assert llava.encoder_inputs == {} and len(llava.replacement) == IMAGE_TOKENS
    # Qwen2-VL's image takes as many tokens as its grid, which embeddings alone do not say.
    with pytest.raises(BadRequestError, match="depends on each image's size"):
        _processor(tiny_qwen2_vl_dir).embeds_template("image", {})
    # Llama 3.2 Vision's cross-attention K/V follow the image's tiles.
    with pytest.raises(BadRequestError, match="cross-attention"):
        _processor(tiny_mllama_dir).embeds_template("image", {})
