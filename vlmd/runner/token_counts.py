"""Per-request token counts for the penalties, kept up to date one token at a time."""

from __future__ import annotations

import torch


class TokenCounts:
    """``output[t]``: how often token t was generated; ``seen[t]``: t is in the prompt or
    the output. Built once when the runner first samples for a request (again after a
    preemption, from the tokens it kept), then updated by ``add`` per sampled token, so a
    step never rebuilds them from the token history.

    Ids outside the logits (e.g. a placeholder id past the output vocabulary) cannot be
    sampled and are left out, as transformers' repetition penalty does.
    """

    def __init__(self, prompt_ids: list[int], output_ids: list[int], vocab_size: int):
        self.vocab_size = vocab_size
        self.output = torch.zeros(vocab_size, dtype=torch.int32)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        prompt = torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long)
        self.seen[prompt] = True
        outputs = torch.tensor([t for t in output_ids if t < vocab_size], dtype=torch.long)
        if outputs.numel():
            self.output += torch.bincount(outputs, minlength=vocab_size).to(torch.int32)
            self.seen[outputs] = True

    def add(self, token_id: int) -> None:
        if token_id < self.vocab_size:
            self.output[token_id] += 1
            self.seen[token_id] = True
