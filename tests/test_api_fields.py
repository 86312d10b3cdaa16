"""Strict request bodies through the front door: every field a client sends either works
or is a 400 that names it; the documented no-effect fields are accepted. Also /tokenize,
/detokenize, /version and /ping, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import io
import wave

import numpy as np
import orjson
import pytest

from conftest import Server, assert_error, image_data_url, image_message, make_video, random_image, video_data_url

TEXT = [{"role": "user", "content": "hi"}]


def _chat(server, **extra):
    return server.chat({"messages": TEXT, "max_tokens": 2, **extra})


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ({"frobnicate": 1}, ("unrecognized", "frobnicate")),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, ("tools", "no tool-call parser")),
        ({"tool_choice": "required"}, ("tool_choice", "no tool-call parser")),
        ({"functions": [{"name": "f"}]}, ("functions",)),
        ({"parallel_tool_calls": True}, ("parallel_tool_calls",)),
        ({"audio": {"voice": "alloy", "format": "wav"}}, ("audio",)),
        ({"modalities": ["text", "audio"]}, ("modalities",)),
        ({"prediction": {"type": "content", "content": "x"}}, ("prediction",)),
        ({"reasoning_effort": "high"}, ("reasoning_effort",)),
        ({"echo": True}, ("echo", "/v1/completions")),
        ({"include_stop_str_in_output": True}, ("include_stop_str_in_output",)),
        ({"no_stop_trim": True}, ("no_stop_trim", "always cut")),
        ({"continue_final_message": True}, ("continue_final_message", "new assistant turn")),
        ({"return_hidden_states": True}, ("return_hidden_states", "hidden states")),
        ({"include_reasoning": "yes"}, ("include_reasoning",)),
        ({"store": True}, ("store",)),
        ({"service_tier": "flex"}, ("service_tier",)),
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, ("continuous_usage_stats",)),
        ({"chat_template_kwargs": {"tokenize": True}}, ("chat_template_kwargs", "tokenize")),
        ({"logit_bias": {"abc": 1}}, ("logit_bias",)),
        ({"logit_bias": {"5": 101}}, ("logit_bias", "-100 and 100")),
        ({"presence_penalty": 2.5}, ("presence_penalty", "-2 and 2")),
        ({"frequency_penalty": -3}, ("frequency_penalty", "-2 and 2")),
        ({"repetition_penalty": 0}, ("repetition_penalty",)),
        ({"min_p": 1.5}, ("min_p",)),
        # Structured outputs are read in one place (protocol.parse_structured_output); bad
        # ones name their field (tests/test_structured_outputs.py has the working ones).
        ({"response_format": {"type": "xml"}}, ("response_format",)),
        ({"guided_choice": "a"}, ("guided_choice",)),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, ("one output constraint",)),
    ],
)
def test_fields_we_do_not_implement_are_400_naming_them(llava_server, extra, fragments):
    status, body = _chat(llava_server, **extra)
    assert_error(status, body, 400, *fragments, param=next(iter(extra)))


def test_no_effect_fields_are_accepted(llava_server):
    base = {"temperature": 0, "max_tokens": 4}
    _, plain = _chat(llava_server, **base)
    status, body = _chat(
        llava_server, **base, user="u-1", metadata={"k": "v"}, store=False, safety_identifier="s",
        prompt_cache_key="p", service_tier="auto", tools=[], tool_choice="none", modalities=["text"],
        response_format={"type": "text"}, parallel_tool_calls=None,
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_the_fields_a_router_adds_are_accepted_at_their_no_op_values(llava_server):
    # What vllm-router 0.1.17 adds to every chat body it forwards (captured from its traffic
    # in an earlier session; issue 33): vlmd must answer as it would without them.
    router_fields = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                     "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                     "return_hidden_states": False, "include_reasoning": True}
    base = {"temperature": 0, "max_tokens": 4}
    _, plain = _chat(llava_server, **base)
    for stream in (False, True):
        status, body = llava_server.request(
            "POST", "/v1/chat/completions",
            orjson.dumps({"model": llava_server.model, "messages": TEXT, **base, **router_fields, "stream": stream}))
        assert status == 200, body
        if not stream:
            assert orjson.loads(body)["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_logit_bias_token_outside_the_vocabulary(llava_server, tiny_llava_dir):
    vocab_size = orjson.loads((tiny_llava_dir / "config.json").read_bytes())["text_config"]["vocab_size"]
    status, body = _chat(llava_server, logit_bias={str(vocab_size): 5})
    assert_error(status, body, 400, "vocabulary size", param="logit_bias")


def test_openai_client_sees_a_named_400_for_tools(llava_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=llava_server.model, messages=TEXT, max_tokens=2,
            tools=[{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}],
        )
    assert "'tools' is not supported" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=llava_server.model, messages=TEXT, max_tokens=2,
                                       extra_body={"top_a": 0.2})
    assert "top_a" in info.value.message


# --- /tokenize, /detokenize, /version, /ping -----------------------------------------------


def _post(server, path, body):
    status, raw = server.request("POST", path, orjson.dumps(body))
    return status, orjson.loads(raw)


def test_tokenize_messages_counts_the_image_placeholders(llava_server):
    messages = image_message("What is this?", random_image(31, 200, 150))
    status, tokens = _post(llava_server, "/tokenize", {"model": llava_server.model, "messages": messages})
    assert status == 200, tokens
    status, chat = llava_server.chat({"messages": messages, "max_tokens": 1, "return_token_ids": True})
    assert tokens["tokens"] == chat["prompt_token_ids"]
    assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 2048
    _, text_only = _post(llava_server, "/tokenize", {"messages": [{"role": "user", "content": "What is this?"}]})
    assert tokens["count"] - text_only["count"] >= 576  # the image's placeholders (and the template's "\n")
    assert tokens["token_strs"] is None


def test_tokenize_prompt_and_detokenize_round_trip(llava_server):
    status, tokens = _post(llava_server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert status == 200
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    _, without = _post(llava_server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert tokens["tokens"][len(tokens["tokens"]) - len(without["tokens"]):] == without["tokens"]  # BOS if any
    status, text = _post(llava_server, "/detokenize", {"tokens": without["tokens"]})
    assert status == 200 and text == {"prompt": "hello world"}
    status, body = _post(llava_server, "/detokenize", {"tokens": [10**9]})
    assert_error(status, body, 400, "token ids", param="tokens")
    status, body = _post(llava_server, "/tokenize", {"prompt": "x", "bogus": 1})
    assert_error(status, body, 400, "bogus", param="bogus")
    status, body = _post(llava_server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404


def test_version_and_ping(llava_server):
    import vlmd

    status, raw = llava_server.request("GET", "/version")
    assert status == 200 and orjson.loads(raw) == {"version": vlmd.__version__}
    assert llava_server.request("GET", "/ping")[0] == 200
    assert llava_server.request("POST", "/ping")[0] == 200


# --- chat_template_kwargs reach the template (Qwen2-VL's add_vision_id) ---------------------


@pytest.fixture(scope="module")
def qwen2_vl_server(tiny_qwen2_vl_dir, tmp_path_factory):
    server = Server(tiny_qwen2_vl_dir, "--max-model-len", "2048", name="tiny-qwen2-vl",
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def test_chat_template_kwargs_change_the_rendered_prompt(qwen2_vl_server):
    messages = image_message("What is this?", random_image(32, 112, 84))
    _, plain = _post(qwen2_vl_server, "/tokenize", {"messages": messages, "return_token_strs": True})
    _, with_id = _post(qwen2_vl_server, "/tokenize", {"messages": messages, "return_token_strs": True,
                                                      "chat_template_kwargs": {"add_vision_id": True}})
    assert with_id["count"] > plain["count"]
    assert "Picture" in "".join(with_id["token_strs"]) and "Picture" not in "".join(plain["token_strs"])
    status, chat = qwen2_vl_server.chat({"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                         "chat_template_kwargs": {"add_vision_id": True}})
    assert status == 200, chat
    assert chat["prompt_token_ids"] == with_id["tokens"]


def test_qwen2_vl_completions_and_n_with_m_rope(qwen2_vl_server):
    """Text prompts get M-RoPE positions from the family's processor too; n greedy choices
    of an image chat are twins."""
    status, raw = qwen2_vl_server.request("POST", "/v1/completions", orjson.dumps(
        {"model": qwen2_vl_server.model, "prompt": "What is", "max_tokens": 4, "temperature": 0, "n": 2}))
    body = orjson.loads(raw)
    assert status == 200, body
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    status, chat = qwen2_vl_server.chat({"messages": image_message("Describe", random_image(35, 112, 84)),
                                         "max_tokens": 4, "temperature": 0, "n": 2, "return_token_ids": True})
    assert status == 200, chat
    assert chat["choices"][0]["token_ids"] == chat["choices"][1]["token_ids"]


def test_qwen2_vl_video_through_responses_and_usage_per_modality(qwen2_vl_server):
    """vLLM's video_url part reaches /v1/responses as it reaches chat; usage counts the
    video's and the image's placeholders apart, and they sum to what /tokenize adds for them."""
    video = {"type": "video_url", "video_url": {"url": video_data_url(make_video(4, seed=5))}}
    image = {"type": "image_url", "image_url": {"url": image_data_url(random_image(36, 112, 84))}}
    messages = [{"role": "user", "content": [video, image, {"type": "text", "text": "Compare."}]}]
    status, chat = qwen2_vl_server.chat({"messages": messages, "max_tokens": 3, "temperature": 0})
    assert status == 200, chat
    status, response = _post(qwen2_vl_server, "/v1/responses", {"model": qwen2_vl_server.model,
        "input": [{"role": "user", "content": [video, image, {"type": "input_text", "text": "Compare."}]}],
        "max_output_tokens": 3, "temperature": 0})
    assert status == 200, response
    assert response["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    counts = chat["usage"]["prompt_tokens_details"]["multimodal_tokens"]
    assert response["usage"]["input_tokens_details"]["multimodal_tokens"] == counts
    _, with_media = _post(qwen2_vl_server, "/tokenize", {"messages": messages})
    _, without = _post(qwen2_vl_server, "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare."}]}]})
    markers = 4  # Qwen2-VL wraps each item's placeholders in a start and an end token
    assert set(counts) == {"video", "image"} and counts["image"] == (112 // 28) * (84 // 28) == 12
    assert counts["video"] + counts["image"] == with_media["count"] - without["count"] - markers
    assert with_media["multimodal_tokens"] == counts and "multimodal_tokens" not in without


# --- the audio form ------------------------------------------------------------------------


def _wav(seconds: float = 1.0) -> bytes:
    samples = (np.sin(np.arange(int(16000 * seconds)) / 10) * 8000).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize(("field", "fragment"), [("chunking_strategy", "30 s"), ("top_p", "unrecognized")])
def test_audio_form_fields_we_do_not_implement_are_400(whisper_server, field, fragment):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=whisper_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model=whisper_server.model, file=("a.wav", _wav()),
                                           extra_body={field: "auto"})
    assert field in info.value.message and fragment in info.value.message


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "user", "content": "hi", "name": "alice"}], "messages[0].name"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
         "messages[1].tool_calls"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}], "cache_control"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": "high"}}]}],
         "detail"),
    ],
)
def test_message_fields_we_do_not_implement_are_400(llava_server, messages, fragment):
    status, body = llava_server.chat({"messages": messages, "max_tokens": 2})
    assert_error(status, body, 400, fragment, param="messages")


def test_message_fields_with_no_effect_are_accepted(llava_server):
    url = image_message("hi", random_image(34, 32, 32))[0]["content"][0]["image_url"]["url"]
    messages = [{"role": "user", "name": None, "content": [
        {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}, {"type": "text", "text": "hi"}]}]
    status, body = llava_server.chat({"messages": messages, "max_tokens": 2})
    assert status == 200, body


def test_text_routes_on_a_speech_model_say_where_it_is_served(whisper_server):
    status, raw = whisper_server.request("POST", "/v1/completions", orjson.dumps(
        {"model": whisper_server.model, "prompt": "hello", "max_tokens": 2}))
    assert_error(status, raw, 400, "/v1/audio/transcriptions")
    status, raw = whisper_server.request("POST", "/tokenize", orjson.dumps({"messages": TEXT}))
    assert_error(status, raw, 400, "/v1/audio/transcriptions")
    status, raw = whisper_server.request("POST", "/tokenize", orjson.dumps({"prompt": "hello"}))
    assert status == 200 and orjson.loads(raw)["count"] > 0


def test_an_image_in_a_tool_result_reaches_the_model(llava_server):
    """Agents return screenshots as tool results. LLaVA's template renders a tool message as
    a user turn, so the same image and text sent as a tool result or as a user message make
    the same prompt and the same greedy answer."""
    url = image_message("hi", random_image(35, 48, 40))[0]["content"][0]["image_url"]["url"]
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "the screenshot"}]
    opening = [{"role": "user", "content": "take a screenshot"}, {"role": "assistant", "content": "done"}]
    as_tool = opening + [{"role": "tool", "tool_call_id": "call_1", "content": parts}]
    as_user = opening + [{"role": "user", "content": parts}]
    answers = []
    for messages in (as_tool, as_user):
        status, body = llava_server.chat({"messages": messages, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        answers.append((body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]))
    assert answers[0] == answers[1] and answers[0][1] > 576


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}],
         "does not render tool calls"),  # LLaVA's template writes an assistant turn's text only
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": 7}}]}],
         "arguments as strings"),
    ],
)
def test_tool_history_the_template_cannot_render_is_a_400(llava_server, messages, fragment):
    status, body = llava_server.chat({"messages": messages, "max_tokens": 2})
    assert_error(status, body, 400, fragment, param="messages")


def test_a_tool_result_image_and_usage_per_modality_through_the_openai_client(llava_server):
    """What an agent sends (a screenshot as a tool result), through the official client: the
    image reaches the model (its 576 placeholders are in the usage, by modality) and the answer
    is the one the same messages get over plain HTTP."""
    from openai import OpenAI

    url = image_data_url(random_image(37, 48, 40))
    messages = [{"role": "user", "content": "take a screenshot"}, {"role": "assistant", "content": "done"},
                {"role": "tool", "tool_call_id": "call_1", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "the screenshot"}]}]
    client = OpenAI(base_url=llava_server.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=llava_server.model, messages=messages, max_tokens=4, temperature=0)
    usage = reply.usage.model_dump()
    assert usage["prompt_tokens_details"]["multimodal_tokens"] == {"image": 576}, usage
    status, body = llava_server.chat({"messages": messages, "max_tokens": 4, "temperature": 0})
    assert status == 200 and reply.choices[0].message.content == body["choices"][0]["message"]["content"]
