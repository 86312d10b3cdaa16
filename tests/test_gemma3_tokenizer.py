"""The tiny Gemma 3 checkpoint's tokenizer is built as Gemma's is: the files and vocabulary
entries vLLM's Gemma 3 processor reads (``vocab["\\n"]`` ... ``vocab["\\n\\n\\n\\n"]``, the image
tokens), one token per newline run, byte fallback for what the vocabulary lacks, the same
bytes from the same seed; vlmd's incremental detokenizer streams its byte pieces whole; and
the newlines joined around images give transformers' prompt ids, as vLLM joins them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from conftest import random_image
from gemma3_oracle import gemma3_inputs

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>")
NEWLINE_RUNS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
NON_ASCII = "Héllo wörld ☃ 日本 — ok"


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_gemma3_dir)


def test_tokenizer_json_is_built_as_gemmas(tiny_gemma3_dir):
    spec = json.loads((tiny_gemma3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert spec["pre_tokenizer"]["type"] == "Split" and spec["pre_tokenizer"]["pattern"] == {"String": " "}
    assert [step["type"] for step in spec["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    model = spec["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] and model["fuse_unk"] and model["unk_token"] == "<unk>"
    vocab = model["vocab"]
    assert [vocab[token] for token in GEMMA_SPECIALS[:5]] == [0, 1, 2, 3, 4]
    assert vocab["<image_soft_token>"] == len(vocab) - 1
    assert all(f"<0x{value:02X}>" in vocab for value in range(256))
    # Newline runs are literal vocabulary entries (vLLM reads them from get_vocab()), not added tokens.
    added = {token["content"]: token for token in spec["added_tokens"]}
    assert all(run in vocab and run not in added for run in NEWLINE_RUNS)
    assert all(added[token]["special"] and added[token]["id"] == vocab[token] for token in GEMMA_SPECIALS)
    # Newlines merge only with newlines: a piece holding one is a run of them.
    assert {piece for piece in vocab if "\n" in piece} == set(NEWLINE_RUNS)


def test_what_vllms_gemma3_processor_looks_up(tiny_gemma3_dir):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_gemma3_dir)
    vocab = processor.tokenizer.get_vocab()
    ids = [vocab[run] for run in NEWLINE_RUNS]
    assert len(set(ids)) == 4
    assert vocab[processor.tokenizer.image_token] == vocab["<image_soft_token>"]
    assert vocab[processor.boi_token] == vocab["<start_of_image>"]
    config = json.loads((tiny_gemma3_dir / "config.json").read_text(encoding="utf-8"))
    assert config["image_token_index"] == vocab["<image_soft_token>"]
    assert config["boi_token_index"] == vocab["<start_of_image>"]


@pytest.mark.parametrize("run", NEWLINE_RUNS)
def test_a_newline_run_is_one_token_whatever_is_around_it(tokenizer, run):
    for text in (f"user{run}", f"{run}Describe", f"one two.{run}three", f"a {run} b"):
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        assert tokens.count(run) == 1 and sum("\n" in token for token in tokens) == 1, (text, tokens)
    five = tokenizer.convert_ids_to_tokens(tokenizer.encode("x\n\n\n\n\ny", add_special_tokens=False))
    assert "".join(token for token in five if "\n" in token) == "\n" * 5


def test_byte_fallback_round_trips_what_the_vocabulary_lacks(tokenizer):
    ids = tokenizer.encode(NON_ASCII, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "<unk>" not in tokens
    assert {"<0xC3>", "<0xA9>", "<0xE2>", "<0x98>", "<0x83>"} <= set(tokens)  # é and ☃ as their bytes
    assert tokenizer.decode(ids) == NON_ASCII
    assert tokenizer.encode("two words", add_special_tokens=False) != tokenizer.encode("twowords", add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode("a  b\tc\n", add_special_tokens=False)) == "a  b\tc\n"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_incremental_detokenizer_streams_byte_pieces_whole(tokenizer, chunk):
    """A character written as 2-3 byte tokens is released only once all its bytes came,
    whichever chunk boundary cuts it: no replacement character, the same text."""
    from vlmd.server.detokenizer import IncrementalDetokenizer

    ids = tokenizer.encode(NON_ASCII, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(ids[start:start + chunk]) for start in range(0, len(ids), chunk)]
    pieces.append(detokenizer.push([], final=True))
    assert "".join(pieces) == NON_ASCII
    assert not any("\ufffd" in piece for piece in pieces), pieces
    # A stop string made of a multi-byte character is found once its bytes are complete.
    stopping = IncrementalDetokenizer(tokenizer, stop=["日本"])
    text = "".join(stopping.push(ids[start:start + chunk]) for start in range(0, len(ids), chunk))
    assert stopping.stopped and text == NON_ASCII[:NON_ASCII.index("日本")]


def test_same_seed_same_tokenizer_across_processes(tiny_gemma3_dir):
    """Another process, one BPE thread and another hash seed: the same tokenizer.json."""
    script = ("import hashlib, sys; from vlmd_gemma3.tiny import _build_tokenizer; "
              "sys.stdout.write(hashlib.sha256(_build_tokenizer(0, 4096).backend_tokenizer.to_str().encode())"
              ".hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="4242", RAYON_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tiny_gemma3_dir).backend_tokenizer.to_str()
    assert proc.stdout == hashlib.sha256(saved.encode()).hexdigest()


def test_join_newlines_as_vllm_joins_them():
    from vlmd_gemma3.processing import join_newlines

    n1, n2, n3, n4 = 101, 102, 103, 104
    assert join_newlines([7, n1, n2, 8], (n1, n2, n3, n4)) == ([7, n3, 8], [0, 1, 1, 2])
    assert join_newlines([n2, n1], (n1, n2, n3, n4)) == ([n3], [0, 0])
    assert join_newlines([8, n2, n2, 9, n2], (n1, n2, n3, n4)) == ([8, n4, 9, n2], [0, 1, 1, 2, 3])
    # vLLM's order: "\n" "\n\n" first, so "\n" "\n\n" "\n\n" is "\n\n\n" "\n\n", never "\n" "\n\n\n\n".
    assert join_newlines([n1, n2, n2], (n1, n2, n3, n4))[0] == [n3, n2]
    assert join_newlines([n1, n1, 5], (n1, n2, n3, n4))[0] == [n1, n1, 5]  # the tokenizer never writes these


MESSAGES = {
    "image_first": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
    "two_in_a_row": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                  {"type": "text", "text": "Compare them."}]}],
    "after_a_system_prompt": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
    "text_then_image": [{"role": "user", "content": [{"type": "text", "text": "Look at this:"}, {"type": "image"}]}],
}


@pytest.mark.parametrize("pan_and_scan", [False, True])
@pytest.mark.parametrize("name", list(MESSAGES))
def test_the_expanded_prompt_is_transformers(tiny_gemma3_dir, tokenizer, name, pan_and_scan):
    """The processor's prompt (newlines joined across the images' edges) is the ids
    transformers' processor gives for the same messages; each item still points at its
    image tokens; ``vlmd cost``'s count (``prompt_tokens``) is its length."""
    from transformers import AutoConfig

    from vlmd.processing.base import ItemSize, ProcessingContext
    from vlmd_gemma3.processing import Gemma3Processor, Gemma3ProcessingInfo

    messages = MESSAGES[name]
    pictures = [random_image(index + 20, 200, 60) for index, _ in enumerate(
        [part for message in messages if isinstance(message["content"], list)
         for part in message["content"] if part["type"] == "image"])]
    kwargs = {"do_pan_and_scan": pan_and_scan}
    info = Gemma3ProcessingInfo(ProcessingContext(model_dir=str(tiny_gemma3_dir), model_id="tiny",
                                                  hf_config=AutoConfig.from_pretrained(tiny_gemma3_dir),
                                                  tokenizer=tokenizer, mm_processor_kwargs=kwargs))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    marked = tokenizer.encode(text, add_special_tokens=False)
    output = Gemma3Processor(info).apply(marked, {"image": pictures}, kwargs)
    expected = gemma3_inputs(tiny_gemma3_dir, messages, pictures, pan_and_scan)["input_ids"][0].tolist()
    assert output.prompt_token_ids == expected
    for item in output.items:
        run = output.prompt_token_ids[item.offset:item.offset + item.length]
        assert run[0] == info.image_token_id == run[-1] and output.prompt_token_ids[item.offset - 1] == info.boi_token_id
    sizes = [info.item_tokens("image", ItemSize(picture.width, picture.height), kwargs) for picture in pictures]
    assert info.prompt_tokens(marked, sizes) == len(expected)
    joined = {"image_first": 1, "two_in_a_row": 2, "after_a_system_prompt": 1, "text_then_image": 0}[name]
    if not pan_and_scan:  # without crops a sequence starts with "\n\n": a join per newline beside it
        assert len(marked) - len(pictures) + sum(size.replacement for size in sizes) - len(expected) == joined
