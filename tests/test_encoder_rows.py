"""The runner's encoder spans: for the tokens a step computes, the batch rows of the
placeholders and each one's vector of its item's stored encoder output. A model with
``merge_multimodal`` receives them gathered (wider than the embeddings if it likes); any
other model gets each span's slice written into its embeddings in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.runner.batch import build_batch
from vlmd.runner.model_runner import encoder_spans, gather_spans
from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import MultiModalItem, SamplingParams


def _state(name, prompt, computed, items):
    return RunnerRequestState(
        request_id=name, token_ids=list(range(1, prompt + 1)), num_prompt_tokens=prompt, mm_items=items,
        sampling=SamplingParams(max_tokens=4), block_tables={0: [0, 1, 2, 3]}, num_computed_tokens=computed,
        stop_token_ids=(),
    )


def _rows(runner, scheduled):
    batch = build_batch(scheduled, attention_backend_for("cpu", 16, "torch"))
    spans = encoder_spans(batch, runner.encoder_outputs)
    return gather_spans(spans, runner.device) if spans else None


def test_a_chunk_gets_the_rows_of_the_part_of_each_item_it_computes():
    wide = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)  # 6 placeholders, 3 values each
    other = torch.full((2, 3), -1.0)
    runner = SimpleNamespace(encoder_outputs={"wide": wide, "other": other}, device=torch.device("cpu"))
    # "a" computes tokens [5, 9) of a prompt whose item fills [3, 9): a chunk (or a prefix
    # hit) that starts inside the item; "b" computes [0, 4) with its item at [1, 3).
    a = _state("a", 12, 5, [MultiModalItem("image", "wide", offset=3, length=6)])
    b = _state("b", 4, 0, [MultiModalItem("image", "other", offset=1, length=2)])
    rows, features = _rows(runner, [(a, 4), (b, 4)])
    assert rows.tolist() == [0, 1, 2, 3, 5, 6]  # a's rows 0..3 are tokens 5..8; b starts at row 4
    assert torch.equal(features, torch.cat([wide[2:6], other]))
    # The next chunk of "a" ([9, 12)) has no placeholder: no rows.
    a.num_computed_tokens = 9
    assert _rows(runner, [(a, 3)]) is None


def test_a_missing_encoder_output_is_an_error_not_a_silent_text_row():
    runner = SimpleNamespace(encoder_outputs={}, device=torch.device("cpu"))
    a = _state("a", 8, 0, [MultiModalItem("image", "gone", offset=2, length=3)])
    with pytest.raises(RuntimeError, match="encoder output for image item gone is missing"):
        _rows(runner, [(a, 8)])


def test_spans_are_views_of_the_stored_output_and_fill_the_same_rows_as_the_gather():
    wide = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    a = _state("a", 12, 5, [MultiModalItem("image", "wide", offset=3, length=6)])
    b = _state("b", 4, 0, [MultiModalItem("image", "wide", offset=1, length=2)])
    batch = build_batch([(a, 4), (b, 4)], attention_backend_for("cpu", 16, "torch"))
    spans = encoder_spans(batch, {"wide": wide})
    # No copy: each span's features share the stored output's memory.
    assert all(features.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr() for _, features in spans)
    in_place = torch.zeros(8, 3)
    for row, features in spans:
        in_place[row : row + len(features)] = features
    gathered = torch.zeros(8, 3)
    rows, features = gather_spans(spans, torch.device("cpu"))
    gathered[rows] = features
    assert torch.equal(in_place, gathered) and in_place.abs().sum() > 0
