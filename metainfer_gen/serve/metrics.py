"""Prometheus metrics of the LLM server, under vLLM V1's names (``docs/design/metrics.md`` in vLLM), so existing
dashboards and the llm-d / Kubernetes autoscaling recipes read them unchanged.

Each server gets its own ``CollectorRegistry`` (two servers in one process never clash). Every series carries
``model_name``. Counters are exposed with prometheus-client's ``_total`` suffix, as vLLM's are:

| name | kind | meaning |
|---|---|---|
| ``vllm:num_requests_running`` | gauge | sequences the scheduler runs (hold KV blocks) |
| ``vllm:num_requests_waiting`` | gauge | sequences queued (no KV blocks yet, or preempted) |
| ``vllm:kv_cache_usage_perc`` | gauge | KV blocks in use, 0-1 (free ones holding a cached prefix count as free) |
| ``vllm:prefix_cache_queries_total`` / ``..._hits_total`` | counter | prompt tokens looked up / found (whole blocks) |
| ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` | counter | prompt tokens admitted / generated |
| ``vllm:num_preemptions_total`` | counter | recompute preemptions |
| ``vllm:request_success_total`` | counter | finished requests by ``finished_reason`` (stop, length, abort, error) |
| ``vllm:time_to_first_token_seconds`` | histogram | arrival at the engine to the first token |
| ``vllm:inter_token_latency_seconds`` | histogram | between consecutive tokens of a request |
| ``vllm:e2e_request_latency_seconds`` | histogram | arrival at the engine to the finished event |
"""

from __future__ import annotations

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The collectors, and the observer methods :class:`~metainfer_gen.serve.async_engine.AsyncLLMEngine` calls
    from its thread (prometheus-client's metrics are thread-safe).

    Args:
        model_name: the served model name (the ``model_name`` label).
    Raises:
        ImportError: prometheus-client is not installed (``pip install 'metainfer-gen[serve]'``).
    """

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(name, doc, **labels).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, **labels).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **labels).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _E2E_BUCKETS)
        self._seen = (0, 0, 0)  # block manager's (queries, hits) and scheduler's preemptions at the last step

    # -- observer interface (engine thread) -------------------------------------------------------------------
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if itl_s is not None:
            self.itl.observe(itl_s)

    def on_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e_s)

    def on_step(self, engine) -> None:
        """Refresh the gauges and counters read from the scheduler and block manager."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(1.0 - blocks.num_free_blocks / blocks.num_blocks)
        now = (blocks.num_prefix_queries, blocks.num_prefix_hits, scheduler.num_preemptions)
        queries, hits, preemptions = (a - b for a, b in zip(now, self._seen))
        self.prefix_queries.inc(queries * blocks.block_size)
        self.prefix_hits.inc(hits * blocks.block_size)
        self.preemptions.inc(preemptions)
        self._seen = now

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
