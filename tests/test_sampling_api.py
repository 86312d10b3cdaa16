"""Sampling parameters through the front door, each asserted by its effect: n choices
(own index, seed stream and finish reason; the prompt's blocks shared through the prefix
cache; usage counts the prompt once), repetition penalty equal to transformers' generate,
presence/frequency penalties by OpenAI's definition (checked against the returned raw
log-probabilities), logit_bias and min_p."""

from __future__ import annotations

import pytest
import torch

from conftest import image_message, random_image
from oracle import load_hf_llava, top2_gap
from test_chat_api import _stream_events

TEXT = [{"role": "user", "content": "Tell me a story about a dog."}]


def _prefix_hits(server) -> float:
    return next(value for name, value in server.metrics().items() if name.startswith("vlmd_prefix_cache_hits"))


def test_n_choices_share_the_prompt_blocks_and_have_their_own_seed_streams(llava_server):
    messages = image_message("Describe it.", random_image(41, 300, 200))
    body = {"messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3, "return_token_ids": True}
    hits_before = _prefix_hits(llava_server)
    status, full = llava_server.chat(body)
    assert status == 200, full
    hits = _prefix_hits(llava_server) - hits_before
    choices = full["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    prompt = full["usage"]["prompt_tokens"]
    assert prompt == len(full["prompt_token_ids"]) > 576  # counted once, not three times
    assert full["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a new image
    # Choices 1 and 2 adopted every full block of the prompt from choice 0.
    assert hits >= 2 * ((prompt - 1) // 16) * 16
    assert len({tuple(c["token_ids"]) for c in choices}) == 3
    for c in choices:
        assert c["finish_reason"] == ("length" if len(c["token_ids"]) == 6 else "stop")
    # Choice i samples with seed + i: the same tokens as a one-choice request with that seed.
    for index in (0, 2):
        _, single = llava_server.chat({**body, "n": 1, "seed": 7 + index})
        assert single["choices"][0]["token_ids"] == choices[index]["token_ids"]

    events = _stream_events(llava_server, {**body, "stream_options": {"include_usage": True}})
    streamed = {i: [] for i in range(3)}
    finishes = {}
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]].extend(choice.get("token_ids") or [])
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert [streamed[i] for i in range(3)] == [c["token_ids"] for c in choices]
    assert finishes == {i: c["finish_reason"] for i, c in enumerate(choices)}
    assert events[-1]["usage"]["prompt_tokens"] == prompt
    assert events[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]


def test_n_with_the_openai_client(llava_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    completion = client.chat.completions.create(model=llava_server.model, messages=TEXT, max_tokens=4, n=2,
                                                temperature=0)
    assert [c.index for c in completion.choices] == [0, 1]
    # Greedy choices agree: the second is the first's twin, computed on shared blocks.
    assert completion.choices[0].message.content == completion.choices[1].message.content


def _greedy_tokens(server, messages=TEXT, **extra) -> dict:
    status, body = server.chat({"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                "return_token_ids": True, **extra})
    assert status == 200, body
    return body


def test_repetition_penalty_equals_transformers_generate(llava_server, tiny_llava_dir):
    # A prompt holding what the model would say, so the penalty has something to act on.
    echo = _greedy_tokens(llava_server)["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": echo * 2}]
    ours = _greedy_tokens(llava_server, messages, repetition_penalty=1.8)
    plain = _greedy_tokens(llava_server, messages)
    model, _ = load_hf_llava(tiny_llava_dir)
    prompt = torch.tensor([ours["prompt_token_ids"]])
    with torch.inference_mode():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                             min_new_tokens=12, do_sample=False, repetition_penalty=1.8, temperature=None,
                             top_p=None, top_k=None, output_scores=True, return_dict_in_generate=True)
    reference = out.sequences[0, prompt.shape[1]:].tolist()
    tokens = ours["choices"][0]["token_ids"]
    for step, (mine, theirs) in enumerate(zip(tokens, reference)):
        if mine != theirs:  # a tie in transformers' own penalized scores is the only excuse
            assert top2_gap(out.scores[step][0]) < 1e-3, (step, tokens, reference)
            break
    else:
        assert tokens == reference
    assert tokens != plain["choices"][0]["token_ids"]  # the penalty changed the answer


def test_presence_and_frequency_penalties_pick_the_penalized_argmax(llava_server):
    """A +10 bias makes token 300 the greedy pick at every step; the penalties then push it
    down each time it is used. Every pick must be the argmax of raw log-prob + bias -
    frequency * count - presence * (count > 0), checked against the 20 best alternatives
    (raw log-probs differ from the logits by a per-step constant, so they rank the same)."""
    presence, frequency, bias = 2.0, 2.0, {"300": 10.0}
    biased = _greedy_tokens(llava_server, logit_bias=bias)["choices"][0]["token_ids"]
    assert biased == [300] * 12
    body = _greedy_tokens(llava_server, logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency,
                          logprobs=True, top_logprobs=20)
    tokens = body["choices"][0]["token_ids"]
    entries = body["choices"][0]["logprobs"]["content"]
    biased_text = next(entry["token"] for token, entry in zip(tokens, entries) if token == 300)
    counts: dict[str, int] = {}
    for entry in entries:
        scores = {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
        scores[entry["token"]] = entry["logprob"]

        def penalized(text: str) -> float:
            extra = bias["300"] if text == biased_text else 0.0
            return scores[text] + extra - frequency * counts.get(text, 0) - presence * (text in counts)

        best_other = max(penalized(text) for text in scores if text != entry["token"])
        assert penalized(entry["token"]) >= best_other - 1e-4, (entry, counts)
        counts[entry["token"]] = counts.get(entry["token"], 0) + 1
    assert tokens[0] == 300 and tokens.count(300) < 12  # used, then penalized away


def test_logit_bias_forces_and_forbids_tokens(llava_server):
    plain = _greedy_tokens(llava_server)["choices"][0]["token_ids"]
    forced = _greedy_tokens(llava_server, logit_bias={"300": 100})["choices"][0]["token_ids"]
    assert forced == [300] * 12
    banned = _greedy_tokens(llava_server, logit_bias={str(t): -100 for t in set(plain)})["choices"][0]["token_ids"]
    assert not set(banned) & set(plain)


def test_min_p_one_keeps_only_the_top_token(llava_server):
    greedy = _greedy_tokens(llava_server)["choices"][0]["token_ids"]
    sampled = _greedy_tokens(llava_server, temperature=1.0, seed=3)["choices"][0]["token_ids"]
    min_p = _greedy_tokens(llava_server, temperature=1.0, seed=3, min_p=1.0)["choices"][0]["token_ids"]
    assert sampled != greedy  # the random model's distribution is wide
    assert min_p == greedy
