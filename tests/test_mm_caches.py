"""The three caches through the front door: the same image is never processed, encoded
or prefilled twice, different images never share, and the metrics say so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, image_message, random_image
from oracle import assert_greedy_match, hf_llava_generate

IMAGE_TOKENS = 576


@pytest.fixture(scope="module")
def server(tiny_llava_dir, tmp_path_factory):
    server = Server(tiny_llava_dir, "--max-model-len", "2048", log_dir=tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


def _ask(server, text, *images, max_tokens=12):
    status, body = server.chat({"messages": image_message(text, *images), "max_tokens": max_tokens,
                                "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    return body


def _reference(model_dir, text, images, max_tokens=12):
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return hf_llava_generate(model_dir, [{"role": "user", "content": parts}], images, max_tokens)


def _delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_same_image_second_question_reuses_every_cache(server, tiny_llava_dir):
    image = random_image(50)
    first = _ask(server, "What is this?", image)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = server.metrics()
    second = _ask(server, "And what colour is it?", image)
    after = server.metrics()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_TOKENS
    assert _delta(before, after, "vlmd_processor_cache_hits_total") == 1
    assert _delta(before, after, "vlmd_decoded_image_hits_total") == 1  # the upload was not decoded again
    assert _delta(before, after, 'vlmd_media_preprocess_seconds_count{modality="image"}') == 0
    assert _delta(before, after, "vlmd_encoder_forwards_total") == 0
    assert _delta(before, after, "vlmd_prefix_cache_hits_total") >= IMAGE_TOKENS
    assert _delta(before, after, "vlmd_prefix_cache_queries_total") == second["usage"]["prompt_tokens"]
    # The cached answer is the cold answer: transformers computes it from scratch.
    reference = _reference(tiny_llava_dir, "And what colour is it?", [image])
    assert second["prompt_token_ids"] == reference["prompt_token_ids"]
    assert_greedy_match(second["choices"][0]["token_ids"], reference)


def test_different_images_of_the_same_size_never_share(server, tiny_llava_dir):
    # Same size, same mode, same text: only the pixels differ (the CVE-2025-46722 class).
    left, right = random_image(60), random_image(61)
    answers = [_ask(server, "Describe.", left), _ask(server, "Describe.", right)]
    # Only text before the image could be shared, and it is shorter than one block.
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] < 16
    for answer, image in zip(answers, (left, right)):
        assert_greedy_match(answer["choices"][0]["token_ids"], _reference(tiny_llava_dir, "Describe.", [image]))


def test_the_same_bytes_with_another_shape_are_another_image(server):
    # Same pixel bytes, transposed dimensions: identifiers must cover the shape.
    wide = random_image(70, 64, 32)
    tall = wide.copy().resize((32, 64))
    tall.frombytes(wide.tobytes())
    first = _ask(server, "Shape?", wide)
    before = server.metrics()
    second = _ask(server, "Shape?", tall)
    after = server.metrics()
    assert _delta(before, after, "vlmd_decoded_image_queries_total") == 1
    assert _delta(before, after, "vlmd_decoded_image_hits_total") == 0
    assert first["prompt_token_ids"] == second["prompt_token_ids"]  # identical placeholders...
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < 16  # ...yet no shared block
    assert _delta(before, after, "vlmd_encoder_forwards_total") == 1
    assert _delta(before, after, "vlmd_processor_cache_hits_total") == 0


def test_same_image_in_eight_concurrent_requests_is_encoded_once(server):
    image = random_image(80)
    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _ask(server, f"Question number {i}?", image), range(8)))
    after = server.metrics()
    assert _delta(before, after, "vlmd_encoder_forwards_total") == 1
    assert _delta(before, after, "vlmd_processor_cache_queries_total") == 8
    assert all(a["usage"]["prompt_tokens"] == answers[0]["usage"]["prompt_tokens"] for a in answers)


def test_metrics_expose_latency_histograms(server):
    _ask(server, "Anything?", random_image(90))
    metrics = server.metrics()
    for name in (
        "vlmd_time_to_first_token_seconds_count",
        "vlmd_inter_token_latency_seconds_count",
        "vlmd_request_queue_time_seconds_count",
        "vlmd_encoder_forward_seconds_count",
        'vlmd_media_fetch_seconds_count{modality="image"}',
        'vlmd_media_preprocess_seconds_count{modality="image"}',
        'vlmd_engine_step_seconds_count{kind="prefill"}',  # the prompt (and its image)
        'vlmd_engine_step_seconds_count{kind="decode"}',  # the answer's later tokens
    ):
        assert metrics.get(name, 0) > 0, name
    assert 0 <= metrics["vlmd_encoder_cache_usage_perc"] <= 1
    assert metrics["vlmd_encoder_cache_queries_total"] >= metrics["vlmd_encoder_cache_hits_total"]


def test_engine_step_seconds_split_one_request_into_its_prefill_and_decode_steps(server):
    before = server.metrics()
    answer = _ask(server, "Count the steps.", random_image(91), max_tokens=9)
    after = server.metrics()
    tokens = answer["usage"]["completion_tokens"]
    # The prompt fits one step's token budget: one prefill step (with the encoder) makes the
    # first token, and each later token is a decode step of this request alone.
    assert _delta(before, after, 'vlmd_engine_step_seconds_count{kind="prefill"}') == 1
    assert _delta(before, after, 'vlmd_engine_step_seconds_count{kind="decode"}') == tokens - 1
    assert _delta(before, after, 'vlmd_engine_step_seconds_sum{kind="prefill"}') >= _delta(
        before, after, "vlmd_encoder_forward_seconds_sum") > 0


def test_caches_can_be_turned_off(tiny_llava_dir, tmp_path):
    server = Server(tiny_llava_dir, "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0", log_dir=tmp_path)
    try:
        image = random_image(95)
        _ask(server, "One?", image)
        before = server.metrics()
        second = _ask(server, "Two?", image)
        after = server.metrics()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _delta(before, after, 'vlmd_media_preprocess_seconds_count{modality="image"}') == 1
        assert _delta(before, after, "vlmd_processor_cache_queries_total") == 0
    finally:
        server.stop()


def test_two_concurrent_requests_for_one_url_fetch_it_once(tiny_llava_dir, tmp_path):
    import http.server
    import io
    import threading
    import time

    payload = io.BytesIO()
    random_image(99).save(payload, "PNG")
    hits = []

    class SlowImage(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            time.sleep(0.5)  # both requests arrive while the first fetch is in flight
            body = payload.getvalue()
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowImage)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    server = Server(tiny_llava_dir, "--allow-private-media-urls", log_dir=tmp_path)
    try:
        url = f"http://127.0.0.1:{media.server_address[1]}/cat.png"
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                            {"type": "text", "text": "Hi"}]}],
                "max_tokens": 4}
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: server.chat(body), range(2)))
        assert [status for status, _ in results] == [200, 200]
        assert hits == ["/cat.png"]
        server.chat(body)  # a later request fetches again: URL content may change
        assert len(hits) == 2
    finally:
        server.stop()
        media.shutdown()


def test_processor_cache_is_an_lru_bounded_by_bytes():
    import numpy as np

    from vlmd.processing.base import ProcessedItem
    from vlmd.processing.cache import ProcessorCache

    def item(size):
        return ProcessedItem(encoder_inputs={"pixels": np.zeros(size, dtype=np.uint8)}, replacement=[])

    cache = ProcessorCache(capacity_bytes=250)
    cache.put("a", item(100))
    cache.put("b", item(100))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", item(100))  # over 250: evicts b, the least recently used
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.nbytes == 200
    cache.put("huge", item(1000))  # larger than the cache: not kept, nothing evicted
    assert cache.get("huge") is None and cache.nbytes == 200
    assert (cache.queries, cache.hits) == (5, 3)


def test_decode_steps_are_counted_by_the_path_the_start_up_log_names(server):
    # Which path a decode step takes is chosen at start-up by timing (and by what the host's
    # kernels read): the test asserts no path, only that /metrics agrees with the log line.
    before = server.metrics()
    answer = _ask(server, "Count the decode steps.", random_image(92), max_tokens=9)
    after = server.metrics()
    decodes = answer["usage"]["completion_tokens"] - 1
    fused = _delta(before, after, 'vlmd_decode_steps_total{path="fused"}')
    modules = _delta(before, after, 'vlmd_decode_steps_total{path="modules"}')
    assert fused + modules == decodes
    logged = [line for line in server.log_path.read_text().splitlines() if "decode steps" in line]
    assert len(logged) == 1, logged  # one decoder, one line
    one_row_fused = "fused" in logged[0] and "M<=4" in logged[0]  # a lone request decodes one row a step
    assert (fused, modules) == ((decodes, 0) if one_row_fused else (0, decodes)), logged[0]
