"""A request's output constraint, compiled off the event loop and the engine thread."""

from __future__ import annotations

import asyncio

from vlmd.errors import BadRequestError
from vlmd.server.state import ServerState


def check_bounds(spec, max_choices: int, max_bytes: int) -> None:
    """A constraint past the server's bounds is a 400 naming the bound, before any compile:
    compile time grows faster than the grammar (vlmd/config.py)."""
    size = len(spec.source.encode())
    if size > max_bytes:
        raise BadRequestError(f"the {spec.kind} constraint is {size} bytes; this server takes at most {max_bytes} "
                              "(--max-structured-output-bytes)", param=spec.param)
    if spec.kind == "choice" and len(spec.choices) > max_choices:
        raise BadRequestError(f"{len(spec.choices)} choices; this server takes at most {max_choices} "
                              "(--max-structured-output-choices)", param=spec.param)


async def compile_structured_output(state: ServerState, spec):
    """The compiled grammar for a request's constraint: from the cache, or compiled on the
    grammar threads (never on the event loop or the engine thread), within
    ``--max-grammar-compile-s`` (vlmd/structured/compile_queue.py). Bad input is a 400 before
    any media is fetched."""
    compiler = state.grammar_compiler
    if compiler is None:
        raise BadRequestError("this model does not support structured outputs", param=spec.param)
    cached = compiler.cached(spec)
    if cached is not None:  # it was within the bounds when it was compiled
        return cached
    check_bounds(spec, state.config.max_structured_output_choices, state.config.max_structured_output_bytes)
    queue = state.grammar_queue
    future = queue.join(spec)
    try:
        # shield: a waiter that times out or leaves must not cancel a compile others share.
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), queue.timeout_s)
    except TimeoutError:
        raise queue.timed_out(spec) from None
    finally:
        queue.leave(spec, future)
