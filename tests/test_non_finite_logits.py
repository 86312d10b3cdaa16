"""NaN logits fail their own request alone, over HTTP (issue 50, item 4).

The server runs with the test-only fault injection (vlmd/testing/faults.py): the decoder's
final hidden state is NaN on every row whose input is ``POISON`` (its K/V stay sound), so a
completion whose prompt ends with it samples from NaN logits. Greedy, sampled and log-prob
requests so poisoned, sent together with good ones of each kind, each fail with a 500 that
names the cause (the sampler's ``NonFiniteLogits``, traced by the engine's fault isolation);
every good one is answered, the greedy ones with the tokens they get alone.
"""

from __future__ import annotations

import threading

import orjson
import pytest

from conftest import Server, assert_error

POISON = 4000
GOOD_PROMPT = [1, 450, 1701, 338]
KINDS = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.9, "seed": 3},
         "logprobs": {"temperature": 0, "logprobs": 2}, "sampled-logprobs": {"temperature": 1.0, "logprobs": 1}}
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def nan_server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--no-warmup", faults={"nan_logits_token_id": POISON},
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _complete(server: Server, prompt: list[int], params: dict) -> tuple[int, dict]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True, **params}
    status, raw = server.request("POST", "/v1/completions", orjson.dumps(body))
    return status, orjson.loads(raw)


def test_poisoned_rows_fail_alone_and_the_good_ones_in_the_same_batch_are_answered(nan_server):
    server = nan_server
    alone = {name: _complete(server, GOOD_PROMPT, params) for name, params in KINDS.items()}
    for name, (status, body) in alone.items():
        assert status == 200, (name, body)
        assert POISON not in body["choices"][0]["token_ids"], "a good request decoded the poison: pick another"
    failed_before = server.metrics()["vlmd_requests_failed_in_step_total"]
    jobs = [(name, GOOD_PROMPT, params) for name, params in KINDS.items()]
    jobs += [(f"poisoned-{name}", [1, 450, POISON], params) for name, params in KINDS.items()]
    results: dict[str, tuple[int, dict]] = {}

    def send(name: str, prompt: list[int], params: dict) -> None:
        results[name] = _complete(server, prompt, params)

    threads = [threading.Thread(target=send, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name in KINDS:
        status, body = results[f"poisoned-{name}"]
        assert_error(status, body, 500, "NonFiniteLogits", param=None)
        status, body = results[name]
        assert status == 200, (name, body)
        tokens = body["choices"][0]["token_ids"]
        assert all(0 <= token < 4096 for token in tokens)
        if KINDS[name].get("temperature") == 0 or "seed" in KINDS[name]:
            assert tokens == alone[name][1]["choices"][0]["token_ids"], name
    assert server.metrics()["vlmd_requests_failed_in_step_total"] - failed_before == len(KINDS)
    assert server.request("GET", "/health")[0] == 200
