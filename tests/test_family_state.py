"""The family seam: what a family's processor makes for one request (its family state) is
carried by the core without being read, and turned into positions only by the model."""

from __future__ import annotations

import dataclasses

import torch

from sched_support import make_request, make_scheduler
from vlmd.layers.attention import attention_backend_for
from vlmd.runner.batch import build_batch
from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import SamplingParams


class _Opaque:
    """A family state no core code can know: any attribute read would raise."""

    def __getattr__(self, name):
        raise AssertionError(f"the core read {name!r} of a family's state")


def test_the_scheduler_hands_the_family_state_to_the_runner_unread():
    scheduler = make_scheduler()
    state = _Opaque()
    scheduler.add_request(dataclasses.replace(make_request("a", 10), family_state=state))
    out = scheduler.schedule()
    (new,) = out.new_requests
    assert new.family_state is state
    assert RunnerRequestState.from_new(new).family_state is state


def _state(name, prompt, computed, family_state=None):
    return RunnerRequestState(
        request_id=name, token_ids=list(range(1, prompt + 1)), num_prompt_tokens=prompt, mm_items=[],
        sampling=SamplingParams(max_tokens=4), block_tables={0: [0, 1, 2, 3]}, num_computed_tokens=computed,
        stop_token_ids=(), family_state=family_state,
    )


def _two_row_positions(family_state, start, end, num_prompt_tokens):
    """A stand-in model: 2-row positions (the second row offset by 100) for requests whose
    family state is a marker, none for the others."""
    if family_state is None:
        return None
    return torch.stack([torch.arange(start, end), torch.arange(start, end) + 100])


def test_positions_come_from_the_model_and_plain_slices_fill_every_row():
    backend = attention_backend_for("cpu", 16, "torch")
    decode, marked, plain = _state("d", 8, 7), _state("m", 5, 0, "marker"), _state("p", 3, 0)
    batch = build_batch([(decode, 1), (marked, 5), (plain, 3)], backend, _two_row_positions)
    assert batch.positions.tolist() == [[7, 0, 1, 2, 3, 4, 0, 1, 2], [7, 100, 101, 102, 103, 104, 0, 1, 2]]
    # No slice with model positions (or no model hook): plain 1-D positions.
    assert build_batch([(decode, 1), (plain, 3)], backend, _two_row_positions).positions.tolist() == [7, 0, 1, 2]
    assert build_batch([(marked, 5)], backend).positions.tolist() == [0, 1, 2, 3, 4]
