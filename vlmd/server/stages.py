"""One request's time to its first token, stage by stage (D109).

The stages are contiguous spans between stamps on one clock (``time.perf_counter()``), so
they add up to the request's time to first token: what the front end, the preprocessing
thread (``processing/stages.py:PreprocessStages``) and the engine
(``vlmd.types.EngineTimings``) each stamped. Observed into ``vlmd_request_stage_seconds``
(labels ``stage`` and ``input``: ``media`` for a request with items, else ``text``) and,
under ``--log-request-stages``, logged as one line per request.
"""

from __future__ import annotations

from vlmd.processing.stages import THREAD_STAGES, PreprocessStages
from vlmd.types import EngineTimings

STAGES = (
    "front_end",  # arrival to the preprocessing pool: body read and parsed, cheap checks, grammar
    "preprocess_queue",  # waiting for a preprocessing thread
    *THREAD_STAGES,  # render (template, tokens), fetch, decode, process (the family's processor)
    "preprocess_other",  # the rest of the thread's work: identifiers, media lease, remote encoders
    "handoff",  # the thread's result back on the event loop, handed to the engine
    "engine_queue",  # waiting to be scheduled (inbox, admission to a step: budgets, blocks, slots)
    "encoder",  # the encoder work of the steps that ran its chunks (its items' or others')
    "prefill",  # the rest of those steps (its prefill chunks, with whatever else they batched)
    "engine_wait",  # admitted, waiting while steps without it ran, and between steps
    "deliver",  # its first token's step end to the event loop holding the token
)


def stage_seconds(started: float, preprocess: PreprocessStages, engine: EngineTimings,
                  first_token_seen: float) -> dict[str, float]:
    """The request's stages (``STAGES``, in seconds); they sum to ``first_token_seen - started``."""
    thread = {name: preprocess.seconds.get(name, 0.0) for name in THREAD_STAGES}
    chunks = sum(engine.chunk_seconds)
    return {
        "front_end": preprocess.submitted - started,
        "preprocess_queue": preprocess.started - preprocess.submitted,
        **thread,
        "preprocess_other": preprocess.ended - preprocess.started - sum(thread.values()),
        "handoff": engine.handed - preprocess.ended,
        "engine_queue": engine.first_scheduled - engine.handed,
        "encoder": engine.encoder_seconds,
        "prefill": chunks - engine.encoder_seconds,
        "engine_wait": engine.first_token - engine.first_scheduled - chunks,
        "deliver": first_token_seen - engine.first_token,
    }
