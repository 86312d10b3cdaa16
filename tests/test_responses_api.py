"""POST /v1/responses through the real server (the shared tiny LLaVA), with the official
openai client and raw HTTP: the same greedy answer as chat, images, json_schema, the cut
at max_output_tokens, the event stream, strict fields; and the prompt's tokens per
modality in chat's and responses' usage."""

from __future__ import annotations

import json
import socket

import jsonschema
import orjson
import pytest
from openai import BadRequestError as OpenAIBadRequest
from openai import OpenAI

from conftest import assert_error, image_data_url, image_message, random_image
from test_disconnect import RUNNING, assert_aborted_early, close_abruptly, wait_until_idle
from vlmd.cost import CostOptions, compute_cost, parse_image
from vlmd.server.modality_tokens import merged_counts, multimodal_token_counts
from vlmd.types import MultiModalItem

EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(llava_server):
    return OpenAI(base_url=llava_server.url + "/v1", api_key="none", max_retries=0)


def _post(server, body: dict) -> tuple[int, dict]:
    status, raw = server.request("POST", "/v1/responses", orjson.dumps({"model": server.model, **body}))
    return status, orjson.loads(raw)


def _image_input(text: str, image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": image_data_url(image), "detail": "auto"},
                                         {"type": "input_text", "text": text}]}]


def test_text_and_instructions_give_chats_greedy_answer(llava_server, client):
    response = client.responses.create(model=llava_server.model, instructions="Answer briefly.",
                                       input="Name a colour.", max_output_tokens=12, temperature=0)
    status, chat = llava_server.chat({"messages": [{"role": "system", "content": "Answer briefly."},
                                                   {"role": "user", "content": "Name a colour."}],
                                      "max_tokens": 12, "temperature": 0})
    assert status == 200, chat
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "Answer briefly." and response.store is False
    # Text only: no per-modality counts on any route.
    assert "multimodal_tokens" not in chat["usage"]["prompt_tokens_details"]
    assert response.usage.input_tokens_details.model_extra.get("multimodal_tokens") is None
    status, raw = llava_server.request("POST", "/v1/completions", orjson.dumps(
        {"model": llava_server.model, "prompt": "Name a colour.", "max_tokens": 2}))
    assert status == 200
    completion_usage = orjson.loads(raw)["usage"]
    # OpenAI's typed fields are always there: every prompt token is text.
    assert completion_usage["prompt_tokens_details"] == {
        "cached_tokens": 0, "text_tokens": completion_usage["prompt_tokens"], "image_tokens": 0, "audio_tokens": 0}


def test_image_input_and_usage_per_modality(llava_server, client, tiny_llava_dir):
    image = random_image(21, 320, 240)
    response = client.responses.create(model=llava_server.model, input=_image_input("Describe it.", image),
                                       max_output_tokens=10, temperature=0)
    status, chat = llava_server.chat({"messages": image_message("Describe it.", image), "max_tokens": 10,
                                      "temperature": 0})
    assert status == 200, chat
    assert response.output_text == chat["choices"][0]["message"]["content"]
    # The image's cost equals vlmd cost's placeholders and /tokenize's whole-prompt count.
    report = compute_cost(str(tiny_llava_dir), [parse_image("320x240")], CostOptions(prompt="Describe it."))
    placeholders = sum(row["placeholder_tokens"] for row in report["items"])
    tokens_status, tokens = llava_server.request("POST", "/tokenize", orjson.dumps(
        {"messages": image_message("Describe it.", image)}))
    assert tokens_status == 200
    assert chat["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": placeholders} == {"image": 576}
    details = response.usage.input_tokens_details.model_extra
    assert details["multimodal_tokens"] == {"image": placeholders}
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"] == orjson.loads(tokens)["count"]
    assert orjson.loads(tokens)["multimodal_tokens"] == {"image": placeholders}  # priced before it is sent


def test_openai_clients_typed_usage_fields_count_the_images_placeholders(llava_server, client, tiny_llava_dir):
    """The official client's ``usage.prompt_tokens_details.image_tokens`` (and ``text_tokens``,
    ``audio_tokens``) are filled, streamed or not: the images' placeholders as vLLM's
    ``multimodal_tokens`` counts them, the rest of the prompt as text."""
    images = [random_image(23, 320, 240), random_image(24, 64, 48)]
    report = compute_cost(str(tiny_llava_dir), [parse_image("320x240"), parse_image("64x48")],
                          CostOptions(prompt="Compare them."))
    placeholders = sum(row["placeholder_tokens"] for row in report["items"])
    assert placeholders == 2 * 576
    reply = client.chat.completions.create(model=llava_server.model, messages=image_message("Compare them.", *images),
                                           max_tokens=3, temperature=0)
    details = reply.usage.prompt_tokens_details
    assert details.image_tokens == placeholders
    assert details.text_tokens == reply.usage.prompt_tokens - placeholders > 0
    assert details.audio_tokens == 0
    assert details.model_extra["multimodal_tokens"] == {"image": placeholders}  # vLLM's spelling beside it
    stream = client.chat.completions.create(model=llava_server.model, messages=image_message("Compare them.", *images),
                                            max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    final = [chunk for chunk in stream if chunk.usage is not None]
    assert len(final) == 1
    assert final[0].usage.prompt_tokens_details.image_tokens == placeholders
    assert final[0].usage.prompt_tokens_details.text_tokens == details.text_tokens
    text = client.completions.create(model=llava_server.model, prompt="Name a colour.", max_tokens=2)
    assert text.usage.prompt_tokens_details.image_tokens == 0
    assert text.usage.prompt_tokens_details.text_tokens == text.usage.prompt_tokens


def test_streaming_events_carry_the_same_answer(llava_server, client):
    body = {"model": llava_server.model, "input": _image_input("What is it?", random_image(22, 96, 96)),
            "max_output_tokens": 9, "temperature": 0}
    full = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    types = [event.type for event in events]
    assert types[:4] == EVENT_ORDER
    assert types[-4:] == [*CLOSING, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == full.output_text
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 9 == full.usage.output_tokens
    assert final.usage.input_tokens_details.model_extra["multimodal_tokens"] == {"image": 576}
    # The same prompt a second time: its image's blocks come from the prefix cache.
    assert final.usage.input_tokens_details.cached_tokens >= 576 > full.usage.input_tokens_details.cached_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert events[2].item.id == final.output[0].id


def test_max_output_tokens_cuts_the_answer_incomplete(llava_server):
    status, body = _post(llava_server, {"input": "Tell me a story.", "max_output_tokens": 3, "temperature": 0})
    assert status == 200, body
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["output_tokens"] == 3
    status, body = _post(llava_server, {"input": "Hi", "max_output_tokens": 8,
                                        "text": {"format": {"type": "json_schema", "name": "flag",
                                                            "schema": {"enum": ["yes", "no"]}}}})
    assert status == 200, body
    assert body["status"] == "completed" and body["incomplete_details"] is None  # the grammar ended it
    assert json.loads(body["output"][0]["content"][0]["text"]) in ("yes", "no")


def test_json_schema_output_is_valid(llava_server, client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(
        model=llava_server.model, input=_image_input("Who is this?", random_image(23, 64, 64)),
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=60, temperature=0)
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    response = client.responses.create(model=llava_server.model, input="An object, please.",
                                       text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text), dict)


def test_assistant_history_and_developer_role_render_as_chat(llava_server):
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": "Again?"}]
    status, body = _post(llava_server, {"input": items, "max_output_tokens": 6, "temperature": 0})
    assert status == 200, body
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again?"}]
    _, chat = llava_server.chat({"messages": messages, "max_tokens": 6, "temperature": 0})
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"previous_response_id": "resp_abc"}, "previous_response_id", "stores no responses"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "tool"),
    ({"tool_choice": "required"}, "tool_choice", "tool"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"background": True}, "background", "while the request waits"),
    ({"truncation": "auto"}, "truncation", "never cut"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"top_logprobs": 2}, "top_logprobs", "log-probabilities"),
    ({"conversation": "conv_1"}, "conversation", "conversations"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "include_obfuscation"),
    ({"text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"text": {"format": {"type": "xml"}}}, "text", "xml"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"$ref": "#"}}}}, "text", "match nothing"),
    ({"max_tokens": 5}, "max_tokens", "unrecognized"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "maximum context length"),
    ({"temperature": -1}, "temperature", "non-negative"),
])
def test_fields_we_do_not_implement_are_400_naming_them(llava_server, extra, param, fragment):
    status, body = _post(llava_server, {"input": "hi", **extra})
    assert_error(status, body, 400, fragment, param=param)


def test_no_op_values_are_accepted(llava_server):
    status, body = _post(llava_server, {
        "input": "hi", "max_output_tokens": 2, "store": True, "parallel_tool_calls": False, "truncation": "disabled",
        "tools": [], "tool_choice": "none", "reasoning": {"effort": "none"}, "background": False, "include": [],
        "metadata": {"team": "a"}, "user": "u1", "safety_identifier": "s", "prompt_cache_key": "k",
        "service_tier": "auto", "top_logprobs": 0, "stream_options": {"include_obfuscation": False},
        "text": {"format": {"type": "text"}, "verbosity": "medium"}, "previous_response_id": None})
    assert status == 200, body
    assert body["store"] is False and body["metadata"] == {"team": "a"} and body["user"] == "u1"
    assert body["parallel_tool_calls"] is False and body["tool_choice"] == "none"
    status, body = _post(llava_server, {"input": "hi", "max_output_tokens": 2, "store": False})
    assert status == 200 and body["store"] is False


@pytest.mark.parametrize(("body", "status", "param", "fragment"), [
    ({"input": []}, 400, "input", "non-empty"),
    ({}, 400, "input", "required"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input", "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "input", "function_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                              "detail": "high"}]}]}, 400, "input", "detail must be 'auto'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     400, "input", "Files API"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}]}, 400, "input", "input_file"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     400, None, "image"),  # chat's decode errors name no field
    ({"input": [{"role": "user", "content": [{"type": "input_audio",
                                              "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     400, "input", "audio"),
    ({"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
])
def test_bad_input_is_an_openai_shaped_4xx(llava_server, body, status, param, fragment):
    got, answer = _post(llava_server, body)
    assert_error(got, answer, status, fragment, param=param)


def test_openai_client_raises_the_named_400(llava_server, client):
    with pytest.raises(OpenAIBadRequest) as raised:
        client.responses.create(model=llava_server.model, input="hi", previous_response_id="resp_1")
    assert raised.value.body["param"] == "previous_response_id"


def test_a_client_that_leaves_mid_stream_aborts_the_request(llava_server):
    wait_until_idle(llava_server)
    before = llava_server.metrics()
    body = orjson.dumps({"model": llava_server.model, "input": "Tell me a very long story.", "stream": True,
                         "max_output_tokens": 1400, "temperature": 0})
    sock = socket.create_connection(("127.0.0.1", llava_server.port), timeout=30)
    sock.sendall((f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    received = b""
    while received.count(b"response.output_text.delta") < 6:  # the request is decoding
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert llava_server.metrics()[RUNNING] >= 1, "the answer ended before the client left"
    close_abruptly(sock)
    after, seconds = wait_until_idle(llava_server)
    assert_aborted_early(before, after, seconds)


def test_multimodal_token_counts_sum_placeholder_runs_per_modality():
    items = [MultiModalItem("image", "a", 5, 576), MultiModalItem("audio", "b", 600, 750),
             MultiModalItem("image", "c", 1400, 64), MultiModalItem("audio", "w", 0, 0, encoder_tokens=1500)]
    assert multimodal_token_counts(items) == {"image": 640, "audio": 750}  # a window without placeholders: none
    assert multimodal_token_counts([]) == {}
    assert merged_counts([{"image": 576}, {}, {"image": 10, "video": 7}]) == {"image": 586, "video": 7}


def test_event_frames_are_numbered_sse_with_the_type_twice():
    """Each frame names its type on the ``event:`` line and in the data (OpenAI sends both);
    numbers run on across frames; an error after the status line is OpenAI's error event."""
    from vlmd.errors import BadRequestError
    from vlmd.server.response_objects import EventStream

    events = EventStream()
    frames = [events.text_delta("msg_1", "a"), events.error(BadRequestError("bad", param="input").to_dict()["error"])]
    parsed = []
    for frame in frames:
        event_line, data_line, *rest = frame.decode().split("\n")
        assert rest == ["", ""] and event_line.startswith("event: ") and data_line.startswith("data: ")
        parsed.append(orjson.loads(data_line[6:]))
        assert parsed[-1]["type"] == event_line[7:]
    assert [p["sequence_number"] for p in parsed] == [0, 1]
    assert parsed[1] == {"type": "error", "sequence_number": 1, "code": "400", "message": "bad", "param": "input"}
