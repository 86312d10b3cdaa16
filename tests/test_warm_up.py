"""A model that cannot run its own warm-up request does not start serving: every request
like it would get a 500, so the operator hears it at start-up, with the cause."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import Server


def test_a_failing_warm_up_is_a_start_up_error(tiny_llava_dir, tmp_path):
    # The injected fault fails every forward holding the first token of the warm-up text.
    token = AutoTokenizer.from_pretrained(tiny_llava_dir).encode("warm up", add_special_tokens=False)[0]
    with pytest.raises(RuntimeError, match="server exited early") as failed:
        Server(tiny_llava_dir, faults={"forward_token_id": token}, log_dir=tmp_path)
    message = str(failed.value)
    assert "vlmd serve: the warm-up request (image) failed" in message
    assert "--no-warmup serves anyway" in message and "Traceback" in message  # the cause is in the log
