"""The tensor-parallel step channel's wire format (vlmd/distributed/step_codec.py, D92):
what rank 0 broadcasts comes back equal, and nothing crosses as pickle."""

from __future__ import annotations

import ast
import json
import pickletools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmd.distributed import step_codec
from vlmd.engine.multiproc_executor import StartupPlan, StepMessage, for_other_ranks
from vlmd.sched.kv_spec import CrossAttention, FullAttention, SlidingWindow, build_kv_cache_config
from vlmd.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vlmd.types import FinishReason, MultiModalItem, SamplingParams

# pickletools' refusal of bytes that are not a pickle stream: an opcode it does not know, or
# the end of the bytes before a STOP.
NOT_A_PICKLE = r"opcode b'.*' unknown|pickle exhausted before seeing STOP"
PICKLE_MARKERS = (b"\x80\x04", b"\x80\x05", b"cbuiltins", b"c__builtin__", b"\x93")


def step_message(grammar=None) -> StepMessage:
    item = MultiModalItem(
        modality="image", identifier="ab" * 32, offset=3, length=4,
        encoder_inputs={"pixel_values": torch.randn(4, 6), "grid_thw": torch.tensor([[1, 2, 2]]),
                        "half": torch.randn(3).to(torch.bfloat16), "mask": np.array([True, False])},
        encoder_tokens=4,
    )
    new = NewRequestData(
        request_id="r1", token_ids=[1, 2, 3, 9, 9, 9, 9, 4], num_prompt_tokens=8, mm_items=[item],
        sampling=SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((3, -1.5),), grammar=grammar),
        block_tables={0: [0, 1], 1: [-1, 5]}, num_computed_tokens=0, stop_token_ids=(2,), family_state=None,
    )
    out = SchedulerOutput(new_requests=[new], cached_requests=[CachedRequestData("r0", {0: [7], 1: [8]}, 15)],
                          num_scheduled_tokens={"r1": 8, "r0": 1}, total_num_scheduled_tokens=9,
                          scheduled_encoder_inputs={"r1": [0]}, evicted_encoder_identifiers=["cd" * 32],
                          dropped_request_ids=["r9"])
    return StepMessage(out, ["r1", "r0"], sampled={"r0": 42}, num_computed_tokens=None)


def test_a_step_message_comes_back_equal():
    message = step_message()
    back = step_codec.decode(step_codec.encode(message))
    assert isinstance(back, StepMessage) and isinstance(back.out, SchedulerOutput)
    assert back.request_ids == message.request_ids and back.sampled == {"r0": 42}
    new, sent = back.out.new_requests[0], message.out.new_requests[0]
    assert (new.token_ids, new.block_tables, new.stop_token_ids) == \
        (sent.token_ids, {0: [0, 1], 1: [-1, 5]}, sent.stop_token_ids)
    assert new.sampling == sent.sampling
    assert back.out.cached_requests == message.out.cached_requests
    assert back.out.num_scheduled_tokens == message.out.num_scheduled_tokens
    item, sent_item = new.mm_items[0], sent.mm_items[0]
    for name, value in sent_item.encoder_inputs.items():
        got = item.encoder_inputs[name]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value)
        else:
            assert np.array_equal(got, value) and got.dtype == value.dtype
    # The KV model crosses whole: every group's kind (a window's size included) and layers.
    kv_cache = build_kv_cache_config([SlidingWindow(24), FullAttention(), SlidingWindow(24), CrossAttention()],
                                     16, 12, slot_bytes=1024)
    plan = StartupPlan(kv_cache, (2, 1, 8), 0)
    assert step_codec.decode(step_codec.encode(plan)) == plan
    assert step_codec.decode(step_codec.encode({FinishReason.STOP: {1, 2}, "t": (1, 2.5)})) == \
        {FinishReason.STOP: {1, 2}, "t": (1, 2.5)}


def test_the_wire_is_not_pickle():
    data = step_codec.encode(step_message())
    (length,) = struct.unpack_from("<Q", data)
    json.loads(data[8 : 8 + length])  # the header is JSON
    assert not any(marker in data[: 8 + length] for marker in PICKLE_MARKERS)
    with pytest.raises(ValueError, match=NOT_A_PICKLE):  # the pickle parser's own refusal, no PROTO or STOP
        list(pickletools.genops(data))


def test_no_module_of_vlmd_imports_pickle():
    """Nothing vlmd sends over a socket or pipe can be a pickle: no module imports it."""
    root = Path(__file__).resolve().parents[1]
    importers = []
    for path in [*root.glob("vlmd/**/*.py"), *root.glob("plugins/*/vlmd_*/**/*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] in ("pickle", "cloudpickle", "dill") for name in names):
                importers.append(str(path.relative_to(root)))
    assert importers == []


@dataclass
class NotOurs:
    value: int


def test_only_vlmd_data_crosses():
    with pytest.raises(TypeError, match="not a vlmd class"):
        step_codec.encode(NotOurs(1))
    with pytest.raises(TypeError, match="cannot cross"):
        step_codec.encode({"f": open})
    with pytest.raises(TypeError, match="cannot cross"):
        step_codec.encode(np.array([object()], dtype=object))


@pytest.mark.parametrize("tree", [
    {"dc": ["os:system", {}]},
    {"e": ["builtins:eval", "1"]},
    {"dc": ["vlmd.engine.multiproc_executor:for_other_ranks", {}]},  # a function, not a class
    {"dc": ["vlmd.distributed.step_codec:json", {}]},  # a module
    {"dc": ["vlmd_not_loaded_anywhere:Thing", {}]},  # never imported by decoding
])
def test_a_crafted_message_names_no_callable(tree):
    header = json.dumps(tree).encode()
    with pytest.raises(TypeError):
        step_codec.decode(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("tree", [{"b": [0, 10]}, {"dc": ["vlmd.engine.multiproc_executor:StartupPlan", {"seed": 1}]},
                                  {"zz": 1}, [1, 2]])
def test_a_malformed_message_is_refused(tree):
    header = json.dumps(tree).encode()
    with pytest.raises(ValueError):
        step_codec.decode(struct.pack("<Q", len(header)) + header)


def test_the_grammar_stays_on_rank_0():
    from vlmd.structured.compiler import CompiledGrammar

    grammar = CompiledGrammar.__new__(CompiledGrammar)  # no plain data: it must not be sent
    message = step_message(grammar)
    with pytest.raises(TypeError, match="CompiledGrammar"):
        step_codec.encode(message)
    sent = step_codec.decode(step_codec.encode(for_other_ranks(message)))
    assert sent.out.new_requests[0].sampling.grammar is None
    assert message.out.new_requests[0].sampling.grammar is grammar  # rank 0's own copy untouched
