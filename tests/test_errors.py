"""The one error vocabulary (vlmd/errors.py): what a client may be shown."""

from __future__ import annotations

from vlmd.errors import MESSAGE_LIMIT, BadRequestError


RUST_PANIC = """invalid grammar: panicked at src/grammar.rs:12:5:
assertion failed: grammar.symbols.len() < u16::MAX as usize - 10
stack backtrace:
   0:     0x7f3a1b2c3d4e - std::backtrace_rs::backtrace::libunwind::trace
   1:     0x7f3a1b2c3d4f - core::panicking::panic
note: run with `RUST_BACKTRACE=full` for a verbose backtrace."""


def test_no_backtrace_or_library_internals_reach_a_client():
    # What llguidance put in a 400's body for a 100,000-option choice (issue 36).
    body = BadRequestError(RUST_PANIC, param="structured_outputs").to_dict()["error"]
    assert body["message"] == "invalid grammar: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"
    assert "backtrace" not in body["message"] and "0x7f3a" not in body["message"] and ".rs:" not in body["message"]
    python = BadRequestError("bad schema\nTraceback (most recent call last):\n  File \"x.py\", line 1")
    assert python.message == "bad schema" and "Traceback" in python.detail  # the log keeps the whole text
    assert BadRequestError("Traceback (most recent call last):\n  File").message.startswith("the request failed")
    long = BadRequestError("x" * 5000).message
    assert len(long) == MESSAGE_LIMIT and long.endswith("\u2026")
    assert BadRequestError("'temperature' must be between 0 and 2").message == "'temperature' must be between 0 and 2"
