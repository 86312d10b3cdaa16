"""structlog set-up: readable lines for a person at a terminal, JSON lines for a log collector."""

from __future__ import annotations

import logging
import os
import sys

import structlog

LOG_FORMATS = ("auto", "text", "json")
# Read by the tensor-parallel rank processes, which log to the same stderr in the same format.
FORMAT_ENV = "VLMD_LOG_FORMAT"


def resolve_format(log_format: str) -> str:
    """`auto` is text when stderr is a terminal (a person reads it) and JSON otherwise (a collector does)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    if log_format == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return log_format


def configure_logging(level: str = "info", log_format: str | None = None) -> None:
    chosen = resolve_format(log_format or os.environ.get(FORMAT_ENV, "auto"))
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if chosen == "text"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr, format="%(message)s")
