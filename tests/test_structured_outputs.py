"""Structured outputs through the HTTP server, with the openai client, on random weights.

Random weights never write JSON by themselves (checked below), so every answer that parses
and validates here was forced by the grammar mask. Covered: several JSON schemas (nested
objects, arrays, enums, required fields), json_object, regex, choice and grammar, vLLM's
``structured_outputs`` and ``guided_*`` shapes, streaming, images in the prompt (LLaVA and
Qwen2-VL), 8 concurrent constrained and unconstrained requests (the unconstrained ones still
equal transformers' greedy tokens), a max_tokens too small (finish "length"), preemption
(seeded answers equal to the same requests run alone), and bad constraints (400s).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from conftest import Server, image_data_url, random_image
from oracle import assert_greedy_match, hf_llava_generate

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
INVOICE = {
    "type": "object",
    "properties": {
        "currency": {"enum": ["EUR", "USD"]},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "item": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "taxed": {"type": "boolean"},
                },
                "required": ["item", "quantity", "taxed"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"], "maxLength": 10},
    },
    "required": ["currency", "lines", "note"],
    "additionalProperties": False,
}
LABELS = {"type": "array", "items": {"enum": ["cat", "dog", "tree", "car"]}, "minItems": 1, "maxItems": 4}
SCHEMAS = {"person": PERSON, "invoice": INVOICE, "labels": LABELS}
MESSAGES = [{"role": "user", "content": "Extract the fields as JSON."}]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _valid(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def client(llava_server):
    return _client(llava_server)


def test_random_weights_do_not_write_json_unconstrained(client):
    # The control: without a constraint the same requests are not JSON, so the mask is what
    # makes every answer below valid.
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, seed=seed)
        with pytest.raises(ValueError):
            json.loads(reply.choices[0].message.content)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate(client, name):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=400, response_format=_schema_format(name), **sampling
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        _valid(choice.message.content, SCHEMAS[name])
        # Whitespace is bounded: outside strings, only the single space after "," and ":".
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', choice.message.content)
        assert not re.search(r"[\r\n\t]| {2,}|(?<![,:]) ", outside_strings), choice.message.content


def test_json_object_regex_choice_and_grammar(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300,
                                           response_format={"type": "json_object"}, temperature=1.0, seed=3)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    pattern = r"[A-Z]{2}-[0-9]{3,5}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, extra_body=body,
                                               temperature=1.0, seed=4)
        assert re.fullmatch(pattern, reply.choices[0].message.content), reply

    options = ["yes", "no", "not sure"]
    seen = set()
    for seed in range(6):
        for body in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
            reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, extra_body=body,
                                                   temperature=1.0, seed=seed)
            assert reply.choices[0].message.content in options
            assert reply.choices[0].finish_reason == "stop"  # complete: nothing else may follow
            seen.add(reply.choices[0].message.content)
    assert len(seen) > 1  # the mask restricts the choice; it does not make it

    lark = 'start: "color=" COLOR ";"\nCOLOR: "red" | "green" | "blue"'
    gbnf = 'root ::= "size=" [0-9] [0-9]? " cm"'
    for body, check in (({"structured_outputs": {"grammar": lark}}, r"color=(red|green|blue);"),
                        ({"guided_grammar": gbnf}, r"size=[0-9][0-9]? cm")):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, extra_body=body,
                                               temperature=1.0, seed=5)
        assert re.fullmatch(check, reply.choices[0].message.content), reply


def test_vllm_json_shapes_and_streaming(client):
    for body in ({"structured_outputs": {"json": INVOICE}}, {"guided_json": json.dumps(INVOICE)}):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, extra_body=body,
                                               temperature=1.0, seed=6)
        _valid(reply.choices[0].message.content, INVOICE)
    for seed in (7, 8):
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=400, stream=True,
                                                response_format=_schema_format("person"), temperature=1.0, seed=seed)
        parts, finish = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        _valid("".join(parts), PERSON)


def test_max_tokens_too_small_is_length_not_a_crash(llava_server, client):
    schema = {**PERSON, "description": "a schema this test alone uses"}
    before = llava_server.metrics()
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].message.content.startswith("{")
    # The server is fine afterwards, and the same schema, now compiled, comes from the cache.
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=400, temperature=0,
        extra_body={"guided_json": schema})
    _valid(reply.choices[0].message.content, PERSON)
    after = llava_server.metrics()
    assert after["vlmd_grammar_compiles_total"] - before["vlmd_grammar_compiles_total"] == 1
    assert after["vlmd_grammar_cache_queries_total"] - before["vlmd_grammar_cache_queries_total"] == 2
    assert after["vlmd_grammar_cache_hits_total"] - before["vlmd_grammar_cache_hits_total"] == 1
    assert after["vlmd_grammar_compile_seconds_count"] - before.get("vlmd_grammar_compile_seconds_count", 0) == 1


def test_bad_constraints_are_400s(client):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "strin"),
        ({"guided_regex": "[a-"}, "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "missing_rule"),
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_choice": []}, "non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"structural_tag": {}}}, "structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one output constraint"),
        ({"response_format": {"type": "xml"}}, "xml"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        # Refused before any compile (issue 36): references that only lead back to
        # themselves (they compiled, then failed inside the engine as a 500), and lists
        # past the server's bounds (100,000 options held a thread for 51 s).
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}},
         "lead back to themselves"),
        ({"guided_choice": [f"option {i}" for i in range(10_001)]}, "--max-structured-output-choices"),
        ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(25_000)}}},
         "--max-structured-output-bytes"),
    ]
    for body, reason in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body)
        assert reason in caught.value.body["message"], (body, caught.value.body)
    # {"type": "text"} is OpenAI's default: no constraint.
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                           response_format={"type": "text"})
    assert reply.choices[0].finish_reason == "length"


def test_batched_constrained_and_unconstrained_with_images(llava_server, tiny_llava_dir, client):
    """8 concurrent requests: constrained ones validate; unconstrained ones equal transformers."""
    images = [random_image(200 + i, 320, 240) for i in range(4)]
    unconstrained = [(images[0], "Describe the picture.", 12), (None, "Tell me a story.", 16),
                     (images[1], "What is here?", 10), (None, "Hello there", 8)]
    constrained = [(images[2], "person"), (None, "invoice"), (images[3], "labels"), (None, "person")]

    def content(image, text):
        if image is None:
            return text
        return [{"type": "image_url", "image_url": {"url": image_data_url(image)}}, {"type": "text", "text": text}]

    def run_unconstrained(case):
        image, text, max_tokens = case
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content(image, text)}], max_tokens=max_tokens,
            temperature=0, extra_body={"return_token_ids": True},
        )

    def run_constrained(case):
        image, name = case
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content(image, "Extract JSON.")}], max_tokens=400,
            response_format=_schema_format(name), temperature=0,
        )

    with ThreadPoolExecutor(8) as pool:
        free = [pool.submit(run_unconstrained, case) for case in unconstrained]
        forced = [pool.submit(run_constrained, case) for case in constrained]
        free, forced = [f.result() for f in free], [f.result() for f in forced]

    for reply, (_, name) in zip(forced, constrained):
        assert reply.choices[0].finish_reason == "stop"
        _valid(reply.choices[0].message.content, SCHEMAS[name])
    for reply, (image, text, max_tokens) in zip(free, unconstrained):
        parts = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
        ref = hf_llava_generate(tiny_llava_dir, [{"role": "user", "content": parts}],
                                [image] if image is not None else [], max_tokens)
        assert_greedy_match(reply.choices[0].model_extra["token_ids"], ref)


def test_preempted_requests_resume_their_grammar(tiny_llava_dir, tmp_path):
    """Seeded constrained requests answer the same alone and when preempted in a crowd: the
    matcher rebuilt after preemption is in the state of the tokens the request has."""
    server = Server(tiny_llava_dir, "--num-kv-blocks", "76", "--max-model-len", "1216",
                    "--max-num-batched-tokens", "4096", log_dir=tmp_path)
    try:
        client = _client(server)

        def run(seed):
            # A different image each: shared prefix blocks would leave the cache room enough.
            image = image_data_url(random_image(300 + seed, 320, 240))
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                     {"type": "text", "text": "Extract JSON."}]}]
            return client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=300, response_format=_schema_format("invoice"),
                temperature=1.0, seed=seed,
            ).choices[0].message.content

        alone = {seed: run(seed) for seed in range(3)}
        for _ in range(3):  # preemption depends on arrival timing on a loaded machine
            with ThreadPoolExecutor(3) as pool:
                crowd = dict(zip(range(3), pool.map(run, range(3))))
            assert crowd == alone
            if server.metrics()["vlmd_num_preemptions_total"] > 0:
                break
        assert server.metrics()["vlmd_num_preemptions_total"] > 0, "the test meant to force preemption"
        for text in alone.values():
            _valid(text, INVOICE)
    finally:
        server.stop()


def test_qwen2_vl_image_extraction(tiny_qwen2_vl_dir, tmp_path):
    server = Server(tiny_qwen2_vl_dir, "--max-model-len", "4096", name="tiny-qwen", log_dir=tmp_path)
    try:
        client = _client(server)
        image = random_image(400, 224, 168)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(image)}},
                                                 {"type": "text", "text": "Extract the invoice."}]}]
        for seed in (0, 1):
            reply = client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=400,
                                                   response_format=_schema_format("invoice"), temperature=1.0,
                                                   seed=seed)
            assert reply.choices[0].finish_reason == "stop"
            _valid(reply.choices[0].message.content, INVOICE)
        stream = client.chat.completions.create(model="tiny-qwen", messages=messages, max_tokens=20, stream=True,
                                                extra_body={"guided_choice": ["invoice", "receipt"]})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text in ("invoice", "receipt")
    finally:
        server.stop()
