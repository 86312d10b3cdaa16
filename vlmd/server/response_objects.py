"""The Responses API's bodies: the ``response`` object, its output message, its usage, and
the numbered SSE events a streamed response is made of (the shapes of the openai
package's ``openai.types.responses``)."""

from __future__ import annotations

from typing import Any

import orjson

from vlmd.server.responses_protocol import ResponsesRequest


def response_object(response_id: str, created_at: int, request: ResponsesRequest, model: str, status: str,
                    output: list[dict], usage: dict | None = None, completed_at: int | None = None) -> dict[str, Any]:
    """``status``: in_progress, completed, or incomplete (the answer reached
    ``max_output_tokens`` or the context's end)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": completed_at,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "metadata": request.metadata,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,  # nothing is kept, whatever was asked (D77)
        "temperature": request.temperature,
        "text": {"format": request.text_format},
        "tool_choice": request.tool_choice,
        "tools": [],
        "top_logprobs": 0,
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
    }


def output_message(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    """The assistant message item; ``text`` None while it has no content part yet."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_usage(chat_usage: dict) -> dict[str, Any]:
    """Chat's usage (``generation.usage``) in the Responses names; the per-modality counts
    keep vLLM's name (``multimodal_tokens``) beside ``cached_tokens``."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": chat_usage["prompt_tokens_details"],
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},  # the served models do not reason
        "total_tokens": chat_usage["total_tokens"],
    }


class EventStream:
    """Numbers a streamed response's events in order and frames them as SSE (an ``event:``
    line with the type, as OpenAI sends, and the JSON ``data:`` line the client parses)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def frame(self, event_type: str, **fields: Any) -> bytes:
        body = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def opening(self, response: dict, item_id: str) -> list[bytes]:
        """What precedes the first text delta: the response created and in progress, its
        message item and that item's (empty) text part."""
        return [
            self.frame("response.created", response=response),
            self.frame("response.in_progress", response=response),
            self.frame("response.output_item.added", output_index=0, item=output_message(item_id, "in_progress", None)),
            self.frame("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                       part=output_text("")),
        ]

    def text_delta(self, item_id: str, delta: str) -> bytes:
        return self.frame("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                          delta=delta, logprobs=[])

    def closing(self, response: dict, item_id: str, text: str) -> list[bytes]:
        """The text, its part and its item done, then the response: ``response.completed``,
        or ``response.incomplete`` when the answer was cut short (OpenAI's two ends)."""
        message = response["output"][0]
        end = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [
            self.frame("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                       logprobs=[]),
            self.frame("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                       part=output_text(text)),
            self.frame("response.output_item.done", output_index=0, item=message),
            self.frame(end, response=response),
        ]

    def error(self, error: dict) -> bytes:
        """A failure after the stream began (the status line is sent): OpenAI's ``error`` event."""
        return self.frame("error", code=str(error["code"]), message=error["message"], param=error["param"])
