"""POST /v1/completions: text (or token-id) prompts, no chat template, JSON or SSE.

A batch of prompts is one engine request per prompt and choice, all submitted together,
so they are batched with each other (and choices of one prompt share its KV blocks).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing

import orjson
from aiohttp import web

from vlmd.errors import BadRequestError, VlmdError
from vlmd.processing.stages import PreprocessStages
from vlmd.server import responses
from vlmd.server.chat import read_text_body
from vlmd.server.completions_protocol import CompletionRequest, parse_completion_request
from vlmd.server.generation import Generation, choice_requests, merged_deltas, usage
from vlmd.server.request_fields import model_not_found
from vlmd.server.state import ServerState
from vlmd.server.structured_output import compile_structured_output


async def completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    state: ServerState = request.app["state"]
    completion = parse_completion_request(await read_text_body(request, state))
    if completion.model != state.config.model_name:
        raise model_not_found(completion.model)
    completion.sampling.check_vocabulary(state.preprocessor.vocab_size)
    _check_prompt_lengths(state, completion)  # 400 before a thread is taken
    grammar = await compile_structured_output(state, completion.structured) if completion.structured else None
    stages = PreprocessStages()  # tokenizing is its preprocess_other
    processed = await state.admission.preprocess(lambda deadline: _process_prompts(state, completion), stages,
                                                 media=False)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    n = completion.sampling.n
    generations = []
    for prompt_index, output in enumerate(processed):
        engine_requests = choice_requests(state, request_id, output, completion.sampling, grammar, prompt_index * n)
        generations.extend(
            Generation(state, engine_request, completion.sampling, started, prompt_index * n + choice, choice == 0,
                       preprocess_stages=stages)
            for choice, engine_request in enumerate(engine_requests)
        )
    echoes = [_echo_text(state, completion, output) for output in processed for _ in range(n)]
    if completion.stream:
        return await _stream(request, state, completion, request_id, generations, echoes)
    return await _complete(state, completion, request_id, generations, echoes)


def _check_prompt_lengths(state: ServerState, completion: CompletionRequest) -> None:
    """Text longer than max_model_len tokens can hold is refused by its characters, in time
    linear in the body, before the tokenizer sees it (as chat messages are)."""
    limit = state.preprocessor.max_prompt_chars
    for index, prompt in enumerate(completion.prompts):
        if isinstance(prompt, str) and len(prompt) > limit:
            where = "prompt" if len(completion.prompts) == 1 else f"prompt[{index}]"
            raise BadRequestError(
                f"{where} holds {len(prompt)} characters, more than max_model_len "
                f"({state.preprocessor.max_model_len}) tokens can hold: at most {limit} characters",
                param="prompt",
            )


def _process_prompts(state: ServerState, completion: CompletionRequest) -> list:
    """Tokenize text prompts and run every prompt through the model's processor (which
    refuses a typed media marker without its item), on the preprocessing pool."""
    outputs = []
    vocab_size = state.preprocessor.vocab_size
    for index, prompt in enumerate(completion.prompts):
        where = "prompt" if len(completion.prompts) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            ids = state.tokenizer.encode(prompt, add_special_tokens=completion.add_special_tokens)
        else:
            ids = prompt
            too_big = [t for t in ids if t >= vocab_size]
            if too_big:
                raise BadRequestError(
                    f"{where} has token id {too_big[0]}, beyond the vocabulary size {vocab_size}", param="prompt"
                )
        if not ids:
            raise BadRequestError(f"{where} is empty (no tokens)", param="prompt")
        outputs.append(state.preprocessor.process_prompt(list(ids)))
    return outputs


def _echo_text(state: ServerState, completion: CompletionRequest, output) -> str:
    if not completion.echo:
        return ""
    return state.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=completion.sampling.skip_special_tokens)


def _logprobs(state: ServerState, completion: CompletionRequest, entries, offset: int = 0) -> dict | None:
    if completion.logprobs is None:
        return None
    return responses.text_logprobs(state.tokenizer, entries, offset)


async def _complete(state: ServerState, completion: CompletionRequest, request_id: str,
                    generations: list[Generation], echoes: list[str]) -> web.Response:
    async with aclosing(merged_deltas(generations)) as deltas:  # an engine error propagates: 400 or 500
        async for _ in deltas:
            pass
    choices = [
        responses.text_choice(
            g.index, echo + g.text, g.finish_reason or "stop", _logprobs(state, completion, g.logprobs, len(echo)),
            g.token_ids if completion.return_token_ids else None,
            g.engine_request.prompt_token_ids if completion.return_token_ids else None,
        )
        for g, echo in zip(generations, echoes)
    ]
    body = responses.text_completion(request_id, int(time.time()), state.config.model_name, choices, usage(generations))
    return web.json_response(body, dumps=_dumps)


async def _stream(request: web.Request, state: ServerState, completion: CompletionRequest, request_id: str,
                  generations: list[Generation], echoes: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    model = state.config.model_name
    offsets = [0] * len(generations)  # characters of each choice's text sent so far

    async def send(body: dict) -> None:
        await response.write(b"data: " + orjson.dumps(body) + b"\n\n")

    echoed = False

    async def send_echoes() -> None:
        """The prompts echoed, when the first token exists: nothing leaves before it (as
        with vLLM), so a client's time to first chunk includes the prefill."""
        nonlocal echoed
        echoed = True
        for g, echo in zip(generations, echoes):
            if echo:
                await send(responses.text_completion(request_id, created, model,
                                                     [responses.text_choice(g.index, echo, None, None)], None, True))

    try:
        try:
            async with aclosing(merged_deltas(generations)) as deltas:
                async for delta in deltas:
                    if not echoed:
                        await send_echoes()
                    if not delta.text and not delta.finish_reason and completion.logprobs is None:
                        continue
                    logprobs = _logprobs(state, completion, delta.logprobs or [], offsets[delta.index])
                    offsets[delta.index] += len(delta.text)
                    choice = responses.text_choice(
                        delta.index, delta.text, delta.finish_reason, logprobs,
                        list(delta.token_ids) if completion.return_token_ids else None,
                    )
                    await send(responses.text_completion(request_id, created, model, [choice], None, True))
        except VlmdError as exc:  # the status line is sent: the error goes in the stream
            await send(exc.to_dict())
        else:
            if not echoed:
                await send_echoes()
            if completion.include_usage:
                await send(responses.usage_chunk(request_id, created, model, usage(generations), "text_completion"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left mid-stream: a normal abort, not a server error
        pass
    return response



def _dumps(body) -> str:
    return orjson.dumps(body).decode()
