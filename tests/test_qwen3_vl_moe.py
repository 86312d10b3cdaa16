"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) through the real server: greedy
tokens equal transformers' generate.

The tiny checkpoint (``vlmd_qwen3_vl/tiny_moe.py``) has 8 experts, 2 a token, on two of its
three text layers (the third dense). One server, under ``--tensor-parallel-size 2`` (each
rank holds half of every expert's columns) with a 32-token step budget that splits images
across steps and a KV cache small enough to preempt; the Qwen3-VL cases run alone, then all
concurrently. The block itself is checked against transformers' in tests/test_moe.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server
from oracle import assert_chat_parity
from test_qwen3_vl import _body, _cases, _max_tokens, _reference

NAMES = ["image_640x480", "two_images", "text_only", "second_turn"]
FLAGS = ("--tensor-parallel-size", "2", "--torch-threads", "1", "--limit-mm-per-prompt", "image=2,video=0",
         "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--num-kv-blocks", "13", "--max-model-len", "200")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen3_vl_moe", tmp_path_factory.mktemp("tiny-qwen3-vl-moe"), seed=0, size="tiny")


@pytest.fixture(scope="module")
def cases():
    every = _cases()
    return [(name, every[name]) for name in NAMES]


@pytest.fixture(scope="module")
def launched(tiny_moe_dir, tmp_path_factory):
    """The server starting while the references are computed."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(Server, tiny_moe_dir, *FLAGS, log_dir=tmp_path_factory.mktemp("qwen3-vl-moe-logs"))
    pool.shutdown(wait=False)
    yield future
    if future.exception() is None:
        future.result().stop()


@pytest.fixture(scope="module")
def references(tiny_moe_dir, cases):
    return {name: _reference(tiny_moe_dir, *case, _max_tokens(i)) for i, (name, case) in enumerate(cases)}


def test_the_checkpoint_is_sparse(tiny_moe_dir):
    import json

    text = json.loads((tiny_moe_dir / "config.json").read_text())["text_config"]
    assert text["num_local_experts"] == 8 and text["mlp_only_layers"] == [1]


def test_parity_alone_then_concurrently_under_tp2_split_and_preempted(launched, cases, references):
    assert_parity_alone_then_concurrently_until_preempted(launched.result(), cases, references)


def assert_parity_alone_then_concurrently_until_preempted(server, cases, references) -> None:
    """Each case alone, then all at once until the server has preempted a request (at most
    eight rounds), every answer transformers'."""
    for index, (name, case) in enumerate(cases):
        status, body = server.chat(_body(*case, _max_tokens(index)))
        assert status == 200, body
        assert_chat_parity(body, references[name])
    for _ in range(8):  # preemption needs the requests to overlap (timing): at most eight rounds
        with ThreadPoolExecutor(len(cases)) as pool:
            bodies = list(pool.map(lambda i: server.chat(_body(*cases[i][1], _max_tokens(i))), range(len(cases))))
        for (status, body), (name, _) in zip(bodies, cases):
            assert status == 200, body
            assert_chat_parity(body, references[name])
        if server.metrics()["vlmd_num_preemptions_total"] > 0:
            break
    assert server.metrics()["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
