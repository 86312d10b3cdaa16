"""Whisper's timestamp rules, as transformers' ``WhisperTimeStampLogitsProcessor`` applies them.

A request predicts timestamps when its decoder prompt asks for it: it ends with the task
token (multilingual: ``<|sot|> <|lang|> <|task|>``) or, for an English-only model, with
``<|startoftranscript|>`` itself; a prompt ending in ``<|notimestamps|>`` does not, nor does
a language-detection prompt (``<|startoftranscript|>`` alone on a multilingual model).
For those rows, after the request's own suppressions:
- ``<|notimestamps|>`` is never sampled;
- timestamps come in pairs: after a lone timestamp, text is forbidden (another timestamp or
  end of text follows); after a pair, another timestamp is forbidden;
- timestamps never decrease (and a closing timestamp may not repeat an earlier one);
- the first token is a timestamp no later than ``max_initial_timestamp_index`` steps;
- when the timestamps together are more likely than the best text token, a timestamp is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TimestampRules:
    no_timestamps_id: int
    timestamp_begin: int
    eos_id: int
    max_initial_timestamp_index: int | None
    prompt_ends: frozenset[int]  # last prompt tokens that ask for timestamps

    @classmethod
    def from_generation_config(cls, generation: dict) -> "TimestampRules | None":
        no_timestamps = generation.get("no_timestamps_token_id")
        if no_timestamps is None:
            return None
        eos = generation.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        if generation.get("is_multilingual") or generation.get("task_to_id"):
            prompt_ends = frozenset(int(i) for i in generation.get("task_to_id", {}).values())
        else:
            prompt_ends = frozenset({int(generation["decoder_start_token_id"])})
        return cls(
            no_timestamps_id=int(no_timestamps),
            timestamp_begin=int(no_timestamps) + 1,
            eos_id=int(eos),
            max_initial_timestamp_index=generation.get("max_initial_timestamp_index"),
            prompt_ends=prompt_ends,
        )

    def predicts_timestamps(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        return num_prompt_tokens > 0 and token_ids[num_prompt_tokens - 1] in self.prompt_ends

    def apply(self, logits: torch.Tensor, states) -> torch.Tensor:
        """Mask ``logits`` ([rows, vocab]) in place for the rows that predict timestamps."""
        begin = self.timestamp_begin
        for row, state in enumerate(states):
            if not self.predicts_timestamps(state.token_ids, state.num_prompt_tokens):
                continue
            if state.sampling.allowed_token_ids is not None:
                continue  # a probe restricted to named tokens (the no-speech probe), not a transcript
            scores = logits[row]
            generated = state.token_ids[state.num_prompt_tokens :]
            scores[self.no_timestamps_id] = NEG_INF
            last_was_timestamp = len(generated) >= 1 and generated[-1] >= begin
            penultimate_was_timestamp = len(generated) < 2 or generated[-2] >= begin
            if last_was_timestamp:
                if penultimate_was_timestamp:
                    scores[begin:] = NEG_INF  # a pair is complete: text (or eos) next
                else:
                    scores[: self.eos_id] = NEG_INF  # a lone timestamp: close it or end
            stamps = [token for token in generated if token >= begin]
            if stamps:
                closing = last_was_timestamp and not penultimate_was_timestamp
                scores[begin : stamps[-1] if closing else stamps[-1] + 1] = NEG_INF
            if not generated:
                scores[:begin] = NEG_INF
                if self.max_initial_timestamp_index is not None:
                    scores[begin + self.max_initial_timestamp_index + 1 :] = NEG_INF
            logprobs = torch.log_softmax(scores.float(), dim=-1)
            if logprobs[begin:].logsumexp(dim=-1) > logprobs[:begin].max():
                scores[:begin] = NEG_INF
        return logits
