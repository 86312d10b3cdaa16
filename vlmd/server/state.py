"""What the HTTP handlers share: the engine facade, the preprocessor, limits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vlmd.config import ServeConfig
from vlmd.engine.async_engine import AsyncEngine


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncEngine
    preprocessor: object  # vlmd.processing.preprocess.InputPreprocessor
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    pool: ThreadPoolExecutor
    metrics: object  # vlmd.server.metrics.Metrics
    # Bounds on waiting work, preprocessing time and decoded media in flight.
    admission: object  # vlmd.server.admission.Admission
    created: int = 0
    # Speech-to-text front end (vlmd_whisper's transcriber); None for other models.
    transcriber: object = None
    # vlmd.structured.compiler.GrammarCompiler: structured outputs, compiled on the pool.
    grammar_compiler: object = None
    # vlmd.structured.compile_queue.CompileQueue: its compiles, bounded in time and number.
    grammar_queue: object = None
    # Set when the model can no longer run (a tensor-parallel rank was lost): /health answers
    # 503 with it and the server exits non-zero.
    fatal_error: str | None = None
