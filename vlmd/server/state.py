"""What the HTTP handlers share: the engine facade, the preprocessor, limits.

The server answers before its model is loaded (every route a 503 "loading", ``app.
until_loaded``): the state exists from the start with its configuration, and the rest is
given at once by ``become_ready`` when the load is done. No handler but the loading answer
runs before then, so the fields a load gives are never read as None.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vlmd.config import ServeConfig
from vlmd.engine.async_engine import AsyncEngine


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncEngine = None
    preprocessor: object = None  # vlmd.processing.preprocess.InputPreprocessor
    tokenizer: object = None
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    pool: ThreadPoolExecutor = None
    metrics: object = None  # vlmd.server.metrics.Metrics
    # Bounds on waiting work, preprocessing time and decoded media in flight.
    admission: object = None  # vlmd.server.admission.Admission
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
    # False while the model loads: every route answers 503 "loading".
    ready: bool = False

    def become_ready(self, **loaded) -> None:
        """The loaded server's parts (every field a load gives), all at once; then ready."""
        missing = {"engine", "preprocessor", "tokenizer", "eos_token_ids", "max_model_len", "pool", "metrics",
                   "admission"} - set(loaded)
        if missing:
            raise ValueError(f"become_ready needs {sorted(missing)}")
        for name, value in loaded.items():
            if not hasattr(self, name):
                raise ValueError(f"ServerState has no field {name!r}")
            setattr(self, name, value)
        self.ready = True
