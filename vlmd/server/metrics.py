"""Prometheus metrics.

Engine figures are read from the worker's stats snapshot at scrape time; timings are
histograms observed where they happen (prometheus_client is thread-safe: the engine
thread and the preprocessing threads observe directly).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STAGE = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# The start-up memory plan (vlmd/engine/memory_plan.py), one gauge per figure.
_PLAN_BYTES = {
    "weight_bytes": "weights",
    "base_bytes": "base",
    "activation_bytes": "activations",
    "encoder_peak_bytes": "encoder_peak",
    "encoder_cache_bytes": "encoder_cache",
    "kv_bytes": "kv_cache",  # every KV group's, cross-attention included: one pool (D95)
    "planned_bytes": "planned",
    "total_bytes": "total",
}


# vLLM's names for the figures a Kubernetes inference gateway routes on (the Gateway API
# Inference Extension's model-server protocol, read by llm-d, KServe and AIBrix): the same
# engine snapshot as vlmd's own gauges, under vLLM's names and labels (docs/deploy.md, D100).
# Both KV names: vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc, and gateways of
# either age scrape one or the other. Fractions 0..1, as vLLM exports them.
_VLLM_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches", lambda stats: stats.num_running),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed", lambda stats: stats.num_waiting),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", lambda stats: stats.kv_usage),
    ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name). 1 means 100 percent usage",
     lambda stats: stats.kv_usage),
)


def _vllm_gauges(stats, model_name: str):
    """``_VLLM_GAUGES`` from one stats snapshot, labelled as vLLM labels them (the served
    model name and the engine index; vlmd has one engine)."""
    for name, doc, read in _VLLM_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric([model_name, "0"], read(stats))
        yield family


class _EngineCollector:
    def __init__(self, engine, processor_cache, admission=None, grammar_compiler=None, memory_plan=None,
                 connections=None, model_name: str = ""):
        self.model_name = model_name
        self.connections = connections  # vlmd.server.connections.ConnectionBound, where served through one
        self.engine = engine
        self.processor_cache = processor_cache
        self.admission = admission
        self.grammar_compiler = grammar_compiler
        self.memory_plan = memory_plan

    def _plan_metrics(self):
        fields = self.memory_plan.fields()
        family = GaugeMetricFamily(
            "vlmd_memory_plan_bytes", "Start-up memory plan: weights, base (process or card), activation and "
            "encoder peaks of the profile, encoder cache, KV cache (every group's), what they come to, "
            "total the utilisation applies to",
            labels=["part", "device", "source"])
        for key, part in _PLAN_BYTES.items():
            family.add_metric([part, fields["device"], fields["source"]], fields[key])
        yield family
        yield GaugeMetricFamily("vlmd_memory_plan_kv_blocks", "KV blocks the memory plan gave", value=fields["num_kv_blocks"])
        yield GaugeMetricFamily("vlmd_memory_plan_kv_block_bytes",
                                "Bytes of one KV block, whatever group holds it (every layer slot's K and V; "
                                "a recurrent state's pages are such blocks)", value=fields["kv_bytes_per_block"])
        yield GaugeMetricFamily("vlmd_memory_plan_max_full_length_requests",
                                "Requests of max_model_len tokens the KV cache holds at once, decoding",
                                value=fields["max_full_length_requests"])
        yield GaugeMetricFamily("vlmd_memory_plan_max_concurrency",
                                "Requests of max_model_len tokens the KV cache holds at once, decoding, as vLLM "
                                "states it (a fraction where the last one fits in part)",
                                value=fields["max_concurrency"])

    def collect(self):
        stats = self.engine.stats
        gauges = {
            "vlmd_num_requests_running": ("Requests in the running batch", stats.num_running),
            "vlmd_num_requests_waiting": ("Requests waiting to be scheduled", stats.num_waiting),
            "vlmd_kv_cache_usage_perc": ("Fraction of KV blocks in use", stats.kv_usage),
            "vlmd_kv_cache_free_blocks": ("KV blocks on the free list", stats.num_free_kv_blocks),
            "vlmd_kv_cache_total_blocks": ("KV blocks in the cache", stats.num_kv_blocks),
            "vlmd_encoder_cache_usage_perc": ("Fraction of encoder-cache slots in use", stats.encoder_cache_usage),
        }
        cache = self.processor_cache
        if cache is not None:
            gauges["vlmd_processor_cache_bytes"] = ("Bytes of processed media cached", cache.nbytes)
        admission = self.admission
        if admission is not None:
            gauges["vlmd_preprocess_in_flight"] = ("Requests taken by or queued for a preprocessing thread",
                                                   admission.num_preprocessing)
            gauges["vlmd_inflight_media_bytes"] = ("Decoded media bytes held by requests in flight",
                                                   admission.media.used_bytes)
        connections = self.connections
        if connections is not None:
            gauges["vlmd_open_connections"] = ("Client connections open (--max-connections bounds them)",
                                               connections.open)
            gauges["vlmd_max_connections"] = ("The bound on open client connections", connections.bound)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _vllm_gauges(stats, self.model_name)
        counters = {
            "vlmd_num_preemptions": ("Requests preempted (recomputed later)", stats.num_preemptions),
            "vlmd_encoder_forwards": ("Media items run through an encoder", stats.num_encoder_forwards),
            "vlmd_encoder_calls": ("Encoder invocations: a step's items of one modality, every request's, "
                                   "go through the encoder in one batch", stats.num_encoder_calls),
            "vlmd_engine_steps": ("Engine steps run", stats.num_steps),
            "vlmd_prompt_tokens": ("Prompt tokens of requests added to the engine", stats.num_prompt_tokens),
            "vlmd_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats.prefix_cache_queries),
            "vlmd_prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
            "vlmd_encoder_cache_queries": ("Encoder-cache lookups", stats.encoder_cache_queries),
            "vlmd_encoder_cache_hits": ("Encoder-cache lookups that found the output", stats.encoder_cache_hits),
            "vlmd_processor_cache_queries": ("Processor-cache lookups", cache.queries if cache else 0),
            "vlmd_processor_cache_hits": ("Processor-cache lookups that hit", cache.hits if cache else 0),
            "vlmd_decoded_image_queries": ("Image uploads looked up by their encoded bytes",
                                           cache.decoded_images.queries if cache else 0),
            "vlmd_decoded_image_hits": ("Image uploads found decoded (no decode)",
                                        cache.decoded_images.hits if cache else 0),
        }
        grammars = self.grammar_compiler
        if grammars is not None:
            counters["vlmd_grammar_cache_queries"] = ("Structured-output grammar lookups", grammars.num_lookups)
            counters["vlmd_grammar_cache_hits"] = ("Grammar lookups found compiled", grammars.num_hits)
            counters["vlmd_grammar_compiles"] = ("Structured-output grammars compiled", grammars.num_compiles)
        if connections is not None:
            counters["vlmd_connections_refused"] = ("Connections closed as accepted, past --max-connections and "
                                                    "its monitoring headroom", connections.refused)
        counters["vlmd_failed_steps"] = ("Engine steps that raised and were re-run without their culprit",
                                         stats.num_failed_steps)
        counters["vlmd_requests_failed_in_step"] = ("Requests a failed engine step was traced to",
                                                    stats.num_requests_failed)
        if admission is not None:
            counters["vlmd_requests_overloaded"] = ("Requests answered 503 at an admission bound",
                                                    admission.num_rejected)
            counters["vlmd_preprocess_timeouts"] = ("Requests past --preprocess-timeout", admission.num_timeouts)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield from _kv_group_metrics(stats.kv_groups, stats.num_kv_blocks)
        paths = CounterMetricFamily(
            "vlmd_decode_steps", "Steps of decodes alone, by path: fused (every layer in one native call, "
            "layers/cpu/fused_step.py) or modules (the model's layers one by one); fused_chunks: steps with short "
            "prefill chunks that ran fused, each chunk's rows as decodes", labels=["path"])
        for path in ("fused", "modules", "fused_chunks"):
            paths.add_metric([path], stats.decode_steps.get(path, 0))
        yield paths
        if self.memory_plan is not None:
            yield from self._plan_metrics()


def _kv_group_metrics(groups: list[dict], num_blocks: int):
    """Per KV group (labels ``group``, ``kind``, ``window``: its tokens for a sliding window,
    else empty): the blocks its tables hold now, their share of the pool every group shares,
    and the most one request has held at once there."""
    if not groups:
        return
    for name, doc, value in (
        ("vlmd_kv_cache_group_blocks", "KV blocks a group's tables hold now (one pool: they sum to the used blocks)",
         lambda group: group["used_blocks"]),
        ("vlmd_kv_cache_group_usage_perc", "Fraction of the KV pool a group holds now",
         lambda group: group["used_blocks"] / num_blocks if num_blocks else 0.0),
        ("vlmd_kv_cache_group_peak_request_blocks", "The most KV blocks one request has held at once in a group",
         lambda group: group["peak_request_blocks"]),
    ):
        family = GaugeMetricFamily(name, doc, labels=["group", "kind", "window"])
        for group in groups:
            family.add_metric([str(group["group"]), group["kind"], str(group.get("window", ""))], value(group))
        yield family


class Metrics:
    def __init__(self, engine, processor_cache=None, grammar_compiler=None, memory_plan=None, admission=None,
                 connections=None, model_name: str = ""):
        """``admission``: the server's vlmd.server.admission.Admission, whose bounds are reported;
        ``connections``: its vlmd.server.connections.ConnectionBound, whose counts are;
        ``model_name``: the served model name, the vLLM-named gauges' ``model_name`` label."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, processor_cache, admission, grammar_compiler, memory_plan,
                                                connections, model_name))

        def histogram(name: str, doc: str, buckets, labels=()):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram("vlmd_time_to_first_token_seconds", "Arrival to first token", _SLOW)
        self.itl = histogram("vlmd_inter_token_latency_seconds", "Between consecutive tokens of a request", _FAST)
        self.queue = histogram("vlmd_request_queue_time_seconds", "Arrival to first scheduling", _SLOW)
        self.encoder = histogram("vlmd_encoder_forward_seconds", "Encoder work in one engine step", _FAST)
        self.step = histogram("vlmd_engine_step_seconds", "One engine step that computed tokens, by kind: decode "
                              "(every chunk one token, no encoder) or prefill (the rest)", _FAST, ("kind",))
        self.fetch = histogram("vlmd_media_fetch_seconds", "Fetch and decode of one item", _FAST, ("modality",))
        self.process = histogram("vlmd_media_preprocess_seconds", "Processor work for one item", _FAST, ("modality",))
        # A request's time to first token, stage by stage (server/stages.py; D109).
        self.stages = histogram("vlmd_request_stage_seconds", "One request's time to its first token by stage "
                                "(they sum to it): front_end, preprocess_queue, render, fetch, decode, process, "
                                "preprocess_other, handoff, engine_queue, encoder, prefill, engine_wait, deliver; "
                                "input: media (with items) or text", _STAGE, ("stage", "input"))
        self.prefill_chunk = histogram("vlmd_prefill_chunk_seconds", "One engine step that ran a prefill chunk of a "
                                       "request before its first token, by input", _FAST, ("input",))
        self.grammar_compile = histogram("vlmd_grammar_compile_seconds", "Compiling one structured-output grammar", _FAST)
        # --encoder-urls: each server's failure, by reason (processing/remote_encoder.py).
        self.encoder_server_failures = Counter(
            "vlmd_encoder_server_failures", "Encoder servers (--encoder-urls) passed over for a request, by reason: "
            "unreachable, timeout (--encoder-timeout-s), error_status, invalid_answer (format, shape, width, "
            "not finite)", ["reason"], registry=self.registry)

    # Observers called from the engine thread and the preprocessing threads.
    def observe_step(self, step) -> None:
        if step.encoder_seconds:
            self.encoder.observe(step.encoder_seconds)
        if step.kind:
            self.step.labels(step.kind).observe(step.step_seconds)
        for seconds in step.queue_seconds:
            self.queue.observe(seconds)

    def observe_stages(self, stages: dict[str, float], kind: str, chunk_seconds: list[float]) -> None:
        for stage, seconds in stages.items():
            self.stages.labels(stage, kind).observe(seconds)
        for seconds in chunk_seconds:
            self.prefill_chunk.labels(kind).observe(seconds)

    def observe_fetch(self, modality: str, seconds: float) -> None:
        self.fetch.labels(modality).observe(seconds)

    def observe_process(self, modality: str, seconds: float) -> None:
        self.process.labels(modality).observe(seconds)

    def observe_encoder_server_failure(self, reason: str) -> None:
        self.encoder_server_failures.labels(reason).inc()

    def observe_grammar_compile(self, seconds: float) -> None:
        self.grammar_compile.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
