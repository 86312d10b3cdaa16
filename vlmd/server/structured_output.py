"""A request's output constraint, compiled off the event loop and the engine thread."""

from __future__ import annotations

import asyncio

from vlmd.errors import BadRequestError
from vlmd.server.state import ServerState


async def compile_structured_output(state: ServerState, spec):
    """The compiled grammar for a request's constraint: from the cache, or compiled on the
    preprocessing pool (never on the event loop or the engine thread). Bad input is a 400
    before any media is fetched."""
    compiler = state.grammar_compiler
    if compiler is None:
        raise BadRequestError("this model does not support structured outputs", param=spec.param)
    cached = compiler.cached(spec)
    if cached is not None:
        return cached
    return await asyncio.get_running_loop().run_in_executor(state.pool, compiler.compile, spec)
