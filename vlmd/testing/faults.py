"""Fault injection for tests: a model whose encoder or forward raises on a marked input.

vlmd never installs it: a test does, on the models ``vlmd.engine.builder.load_model``
loads, either in its own process (``loading_with_faults``) or in a server it starts as
``python -m vlmd.testing.run_with_faults vlmd serve ...`` (whose tensor-parallel ranks start
the same way). Installed, it is still off unless the ``VLMD_FAULT_INJECTION`` environment
variable is set, e.g.
``VLMD_FAULT_INJECTION='{"encoder_pixel_value": 13, "forward_token_id": 4242}'``:

- ``encoder_pixel_value``: the image encoder raises for a batch holding an item whose
  uint8 pixels all equal this value (a solid-colour image stays solid through resizing);
- ``forward_token_id``: the decoder forward raises for a batch holding this token id,
  *after* the real forward ran, so the failed step has already written K/V for every
  request in it: the worst case for re-running the step without the culprit;
- ``nan_logits_token_id``: the decoder's final hidden state is NaN on each row whose input
  is this token (its K/V stay sound), so a request whose prompt ends with it samples from
  NaN logits, as a bad checkpoint or an overflow would make it.

- ``load_waits_for``: a path; loading the model waits until that file exists, so a test
  holds the server in its loading state for as long as it looks at it.

The first two fail the whole batch, as a real shape bug or a bad input would, and the third
reaches the sampler beside good rows: the engine must find the culprit itself.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import structlog

log = structlog.get_logger(__name__)

ENV = "VLMD_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    pass


def loading_with_faults(load_model):
    """``load_model`` (``vlmd.engine.builder.load_model``), installing the faults of
    ``VLMD_FAULT_INJECTION`` on every model it returns: after its kernels are chosen, as the
    server then runs it."""

    def load_model_with_faults(*args, **kwargs):
        _wait_for_release()
        model = load_model(*args, **kwargs)
        install_from_env(model)
        return model

    return load_model_with_faults


def _wait_for_release(limit_s: float = 600.0) -> None:
    """Hold the load while ``load_waits_for``'s file does not exist (at most ``limit_s``)."""
    spec = os.environ.get(ENV)
    path = json.loads(spec).get("load_waits_for") if spec else None
    if path is None:
        return
    log.warning("fault injection: the load waits for a file (tests only)", path=path)
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def install_from_env(model) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    settings = json.loads(spec)
    log.warning("fault injection is on (tests only)", settings=settings)
    pixel_value = settings.get("encoder_pixel_value")
    if pixel_value is not None:
        _poison_encoder(model, int(pixel_value))
    token_id = settings.get("forward_token_id")
    if token_id is not None:
        _poison_forward(model, int(token_id))
    nan_token_id = settings.get("nan_logits_token_id")
    if nan_token_id is not None:
        _poison_logits(model, int(nan_token_id))


def _poison_encoder(model, pixel_value: int) -> None:
    encode = model.embed_multimodal

    def embed_multimodal(modality, encoder_inputs):
        for inputs in encoder_inputs:
            pixels = inputs.get("pixels")
            if pixels is not None and np.size(pixels) and bool(np.all(np.asarray(pixels) == pixel_value)):
                raise InjectedFault(f"injected encoder fault: a {modality} item of solid value {pixel_value}")
        return encode(modality, encoder_inputs)

    model.embed_multimodal = embed_multimodal


def _poison_forward(model, token_id: int) -> None:
    embed, forward = model.embed_input_ids, model.forward
    batch = {"poisoned": False}

    def embed_input_ids(input_ids):
        batch["poisoned"] = bool((input_ids == token_id).any())
        return embed(input_ids)

    def poisoned_forward(*args, **kwargs):
        hidden = forward(*args, **kwargs)  # K/V of the whole batch are written first
        if batch["poisoned"]:
            raise InjectedFault(f"injected forward fault: token {token_id} in the batch")
        return hidden

    model.embed_input_ids = embed_input_ids
    model.forward = poisoned_forward


def _poison_logits(model, token_id: int) -> None:
    embed, forward = model.embed_input_ids, model.forward
    batch = {"input_ids": None}

    def embed_input_ids(input_ids):
        batch["input_ids"] = input_ids
        return embed(input_ids)

    def nan_forward(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        input_ids = batch["input_ids"]
        outputs = kwargs.get("outputs")  # given, the model returns only the rows that sample
        tokens = input_ids if outputs is None else input_ids[outputs.rows.to(input_ids.device)]
        poisoned = tokens == token_id
        if bool(poisoned.any()):
            hidden = hidden.clone()
            hidden[poisoned.to(hidden.device)] = float("nan")
        return hidden

    model.embed_input_ids = embed_input_ids
    model.forward = nan_forward
