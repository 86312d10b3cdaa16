"""Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``) through the real server: greedy tokens
equal transformers' generate.

The tiny checkpoint (``vlmd_qwen3_5/tiny_moe.py``) has 8 experts, 2 a token, and a shared
expert on every text layer of Qwen3.5's hybrid layout (six layers, the last a linear-attention
one), its experts saved one tensor each, as transformers saves them. One server, under ``--tensor-parallel-size 2`` (each rank holds half
of every expert's columns, half of the attention and linear-attention heads, and its half of
each recurrent state) with a 32-token step budget that splits prompts across steps (the
states carried between chunks) and a KV cache small enough to preempt (a preempted request's
states are computed again from its tokens). Qwen3.5's cases run alone, then all concurrently.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server
from test_qwen3_5 import _cases
from test_qwen3_vl import _max_tokens, _reference
from test_qwen3_vl_moe import assert_parity_alone_then_concurrently_until_preempted

NAMES = ["image_640x480", "two_images", "text_only", "long_text"]
FLAGS = ("--tensor-parallel-size", "2", "--torch-threads", "1", "--limit-mm-per-prompt", "image=2,video=0",
         "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--num-kv-blocks", "40", "--max-model-len", "480")


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from vlmd.testing.tiny import build_tiny

    return build_tiny("qwen3_5_moe", tmp_path_factory.mktemp("tiny-qwen3-5-moe"), seed=0, size="tiny")


@pytest.fixture(scope="module")
def cases():
    every = _cases()
    return [(name, every[name]) for name in NAMES]


@pytest.fixture(scope="module")
def launched(tiny_moe_dir, tmp_path_factory):
    """The server starting while the references are computed."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(Server, tiny_moe_dir, *FLAGS, log_dir=tmp_path_factory.mktemp("qwen3-5-moe-logs"))
    pool.shutdown(wait=False)
    yield future
    if future.exception() is None:
        future.result().stop()


@pytest.fixture(scope="module")
def references(tiny_moe_dir, cases):
    return {name: _reference(tiny_moe_dir, *case, _max_tokens(i)) for i, (name, case) in enumerate(cases)}


def test_the_checkpoint_is_sparse_and_hybrid(tiny_moe_dir):
    text = json.loads((tiny_moe_dir / "config.json").read_text())["text_config"]
    assert text["num_experts"] == 8 and text["shared_expert_intermediate_size"] == 48
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2


def test_parity_alone_then_concurrently_under_tp2_split_and_preempted(launched, cases, references):
    assert_parity_alone_then_concurrently_until_preempted(launched.result(), cases, references)


def test_a_missing_expert_is_refused(tiny_moe_dir):
    """transformers saves each expert's projections apart; the loader fills the fused tensors
    from them and refuses a checkpoint that lacks one."""
    from transformers import AutoConfig

    from vlmd.models.loader import iterate_weights
    from vlmd_qwen3_5.model import Qwen3_5Model

    weights = [(name, tensor) for name, tensor in iterate_weights(tiny_moe_dir)
               if not name.endswith("layers.2.mlp.experts.5.up_proj.weight")]
    with pytest.raises(ValueError, match="15 of the 16 per-expert tensors of layers.2.mlp.experts.gate_up_proj"):
        Qwen3_5Model(AutoConfig.from_pretrained(tiny_moe_dir)).load_weights(weights)
