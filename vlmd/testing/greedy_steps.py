"""A decoder's greedy steps driven directly (no server): a prompt of token ids in one
prefill chunk, then one decode step at a time through the paged CPU attention backend, as
the engine runs them. For the weight-format accuracy tests (tests/test_quantized_linear.py)
and the decode benchmark (contrib/bench/bench_quantized_decode.py): the same model loaded
in float32, bfloat16 or int8 is stepped over the same tokens and its log-probabilities
compared, or its steps timed.

``teacher`` (token ids): feed those tokens instead of the model's own choices, so that two
models are compared on one context however their greedy choices differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vlmd.layers.attention import SequenceChunk, attention_backend_for

BLOCK = 16


@dataclass
class Steps:
    tokens: list[int]  # the greedy choice after the prompt and after each step
    log_probs: list[torch.Tensor]  # float32 [vocab] per choice
    step_seconds: list[float] = field(default_factory=list)  # each decode step's forward and logits
    decode_paths: dict = field(default_factory=dict)  # the backend's steps by path (fused / modules)


def language_model(model):
    """The decoder-only language model of a multimodal model (itself for a text model)."""
    return getattr(model, "language_model", model)


@torch.inference_mode()
def greedy_steps(model, prompt: list[int], steps: int, teacher: list[int] | None = None,
                 attention_kernels: str = "auto") -> Steps:
    lm = language_model(model)
    spec = lm.kv_spec
    total = len(prompt) + steps + 1
    blocks = list(range(1, -(-total // BLOCK) + 1))
    dtype = lm.embed_input_ids(torch.tensor([0])).dtype
    caches = [(torch.zeros((len(blocks) + 1) * BLOCK, spec.num_kv_heads, spec.head_dim, dtype=dtype),
               torch.zeros((len(blocks) + 1) * BLOCK, spec.num_kv_heads, spec.head_dim, dtype=dtype))
              for _ in range(spec.num_layers)]
    backend = attention_backend_for("cpu", BLOCK, attention_kernels)
    out = Steps([], [])
    ids, start, count = list(prompt), 0, len(prompt)
    for step in range(steps + 1):
        meta = backend.prepare_metadata([SequenceChunk(blocks, start, count)], 0 if step == 0 else 1)
        embeds = lm.embed_input_ids(torch.tensor(ids[start:start + count]))
        began = time.perf_counter()
        hidden = lm(embeds, torch.arange(start, start + count), meta, caches)
        logits = lm.compute_logits(hidden[-1:])  # part of the step: the LM head reads its weight too
        if step:
            out.step_seconds.append(time.perf_counter() - began)
        log_probs = torch.log_softmax(logits.float(), dim=-1)[0]
        choice = int(log_probs.argmax())
        out.tokens.append(choice)
        out.log_probs.append(log_probs)
        ids.append(choice if teacher is None else teacher[step])
        start, count = start + count, 1
    out.decode_paths = dict(backend.decode_steps)
    return out


def agreement(reference: Steps, other: Steps) -> dict:
    """``other`` (run with ``teacher=reference.tokens``) against ``reference``: the share
    of steps whose greedy choice agrees, the largest change of the log-probability of
    ``reference``'s choice, and the largest change over the whole vocabulary."""
    agree = sum(a == b for a, b in zip(reference.tokens, other.tokens))
    chosen = max(abs(float(r[t] - o[t])) for r, o, t in zip(reference.log_probs, other.log_probs, reference.tokens))
    whole = max(float((r - o).abs().max()) for r, o in zip(reference.log_probs, other.log_probs))
    return {"steps": len(reference.tokens), "top1_agreement": agree / len(reference.tokens),
            "max_chosen_logprob_delta": chosen, "max_logprob_delta": whole}
