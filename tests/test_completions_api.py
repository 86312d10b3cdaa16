"""POST /v1/completions through the front door: text and token-id prompts, batches,
n, streaming, echo, legacy logprobs, the sampling parameters, and named 400s."""

from __future__ import annotations

import orjson
import pytest

from conftest import assert_error


def _complete(server, **body):
    status, raw = server.request("POST", "/v1/completions", orjson.dumps({"model": server.model, **body}))
    return status, orjson.loads(raw)


def _events(server, **body) -> list[dict]:
    status, raw = server.request("POST", "/v1/completions",
                                 orjson.dumps({"model": server.model, **body, "stream": True}))
    assert status == 200, raw
    lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def _token_ids(server, text: str) -> list[int]:
    _, raw = server.request("POST", "/tokenize", orjson.dumps({"prompt": text}))
    return orjson.loads(raw)["tokens"]


def test_text_and_token_id_prompts_agree(llava_server):
    prompt = "Once upon a time"
    status, text = _complete(llava_server, prompt=prompt, max_tokens=8, temperature=0, return_token_ids=True)
    assert status == 200, text
    assert text["object"] == "text_completion"
    choice = text["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("length", "stop")
    ids = _token_ids(llava_server, prompt)
    assert choice["prompt_token_ids"] == ids
    assert text["usage"]["prompt_tokens"] == len(ids)
    _, by_ids = _complete(llava_server, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids["choices"][0]["text"] == choice["text"]
    # The default max_tokens is OpenAI's 16.
    _, default = _complete(llava_server, prompt=ids, temperature=0, ignore_eos=True)
    assert default["usage"]["completion_tokens"] == 16


def test_a_batch_of_prompts_with_n_orders_choices_prompt_major(llava_server):
    prompts = ["The cat", "A dog ran"]
    status, body = _complete(llava_server, prompt=prompts, max_tokens=5, n=2, temperature=0)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for index, prompt in enumerate(prompts):
        _, alone = _complete(llava_server, prompt=prompt, max_tokens=5, temperature=0)
        first, second = body["choices"][2 * index : 2 * index + 2]
        assert first["text"] == second["text"] == alone["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == sum(len(_token_ids(llava_server, p)) for p in prompts)
    _, batched_ids = _complete(llava_server, prompt=[_token_ids(llava_server, p) for p in prompts], max_tokens=5,
                               temperature=0)
    assert [c["text"] for c in batched_ids["choices"]] == [body["choices"][0]["text"], body["choices"][2]["text"]]


def test_streaming_matches_the_full_answer_with_usage(llava_server):
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 1.0, "seed": 4, "n": 2}
    _, full = _complete(llava_server, **body)
    events = _events(llava_server, **body, stream_options={"include_usage": True})
    texts, finishes = {0: "", 1: ""}, {}
    for event in events[:-1]:
        assert event["object"] == "text_completion"
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert [texts[0], texts[1]] == [c["text"] for c in full["choices"]]
    assert finishes == {c["index"]: c["finish_reason"] for c in full["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]


def test_echo_and_legacy_logprobs(llava_server):
    prompt = "Echo me"
    _, plain = _complete(llava_server, prompt=prompt, max_tokens=4, temperature=0)
    _, echoed = _complete(llava_server, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    _, scored = _complete(llava_server, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    logprobs = scored["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert "".join(logprobs["tokens"]) == scored["choices"][0]["text"]
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and value <= 0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the best
    assert logprobs["text_offset"][0] == 0


def test_sampling_parameters_work_here_too(llava_server):
    _, forced = _complete(llava_server, prompt="x", max_tokens=5, temperature=0, logit_bias={"300": 100},
                          return_token_ids=True)
    assert forced["choices"][0]["token_ids"] == [300] * 5
    _, stopped = _complete(llava_server, prompt="x", max_tokens=5, temperature=0, logit_bias={"300": 100},
                           stop_token_ids=[300], return_token_ids=True)
    assert stopped["choices"][0]["token_ids"] == [300] and stopped["choices"][0]["finish_reason"] == "stop"


def test_openai_client_completions(llava_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    completion = client.completions.create(model=llava_server.model, prompt="Hi", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    stream = client.completions.create(model=llava_server.model, prompt="Hi", max_tokens=4, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == completion.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=llava_server.model, prompt="Hi", max_tokens=4, suffix="end")
    assert "suffix" in info.value.message


@pytest.mark.parametrize(
    ("extra", "param", "fragments"),
    [
        ({"prompt": ""}, "prompt", ("empty",)),
        ({"prompt": []}, "prompt", ("empty",)),
        ({"prompt": [1, "a"]}, "prompt", ("token ids",)),
        ({"prompt": [10**9]}, "prompt", ("vocabulary size",)),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo", ("echo", "logprobs")),
        ({"prompt": "x", "best_of": 3}, "best_of", ("best_of",)),
        ({"prompt": "x", "logprobs": 21}, "logprobs", ("logprobs",)),
        ({"prompt": "x", "n": 17}, "n", ("n",)),
        ({"prompt": ["x"] * 40, "n": 2}, "prompt", ("64",)),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens", ("context length",)),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", ("response_format",)),
        ({"prompt": "x", "whatever": 1}, "whatever", ("unrecognized",)),
        ({"prompt": "USER: <image>\nWhat?"}, None, ("image",)),
    ],
)
def test_bad_completion_requests(llava_server, extra, param, fragments):
    status, body = _complete(llava_server, **{"max_tokens": 2, **extra})
    assert_error(status, body, 400, *fragments, **({"param": param} if param else {}))


def test_structured_outputs_constrain_text_completions(llava_server):
    """The same grammar path as chat: every choice of a batch is one of the allowed answers,
    and a JSON schema's answer parses (random weights never write either by themselves)."""
    choices = ["alpha", "beta gamma"]
    status, body = _complete(llava_server, prompt=["Pick:", "Again:"], n=2, temperature=1.0, seed=3,
                             max_tokens=20, structured_outputs={"choice": choices})
    assert status == 200, body
    assert len(body["choices"]) == 4
    assert all(c["text"] in choices and c["finish_reason"] == "stop" for c in body["choices"])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    status, body = _complete(llava_server, prompt="JSON:", max_tokens=30, temperature=0,
                             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert status == 200, body
    answer = orjson.loads(body["choices"][0]["text"])
    assert set(answer) == {"ok"} and isinstance(answer["ok"], bool)
    assert body["choices"][0]["finish_reason"] == "stop"
