"""Prometheus metrics of one server, in a registry of its own (several servers may share a process).

Names follow vLLM's where one fits (`vllm:` becomes `specexport:`), so dashboards written for
vLLM's speculative decoding need only the prefix changed:
    specexport:spec_decode_num_drafts_total                 draft rounds (one target verify call each)
    specexport:spec_decode_num_draft_tokens_total           drafted tokens
    specexport:spec_decode_num_accepted_tokens_total        accepted drafted tokens
    specexport:spec_decode_num_accepted_tokens_per_pos_total  accepted tokens by draft position (label `position`)
The spec_decode counters carry `proposer` besides `model_name` (the source a round came from: for
the hybrid proposer 'draft' or 'lookup'), so acceptance is visible per proposer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..generator import GenerationStats

PREFIX = "specexport:"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX_GAUGES = {  # PrefixPool.describe() key -> help of its gauge specexport:prefix_cache_<key>
    "bytes": "Bytes of K/V rows held by the prefix pool.",
    "max_bytes": "The prefix pool's memory bound in bytes.",
    "tokens": "Token positions held by the prefix pool.",
    "evictions": "Pool nodes evicted for the memory bound (since start).",
    "token_hit_rate": "Prompt tokens served from the pool / prompt tokens looked up (since start).",
}


class Metrics:
    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model = model_name
        m, spec = ["model_name"], ["model_name", "proposer"]
        self.drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Speculative rounds (draft + one verify call).", spec, registry=registry
        )
        self.draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Drafted tokens.", spec, registry=registry)
        self.accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Accepted drafted tokens.", spec, registry=registry
        )
        self.accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by draft position (0 = first).",
            ["model_name", "position"],
            registry=registry,
        )
        self.drafted_per_pos = Counter(
            PREFIX + "spec_decode_num_draft_tokens_per_pos",
            "Drafted tokens by draft position (0 = first).",
            ["model_name", "position"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests that ran.", m, registry=registry
        )
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix pool.", m, registry=registry
        )
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix pool.", m, registry=registry
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", m, registry=registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Request arrival to first token (queue included).",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Decode seconds per output token after the first, one observation per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request arrival to last token.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds a request waited in the queue.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests in the queue.", m, registry=registry)
        self.running = Gauge(
            PREFIX + "num_requests_running", "Requests generating (at most --max-batch).", m, registry=registry
        )
        self.batch_size = Histogram(
            PREFIX + "batch_size",
            "Sequences in each batched target call (serve --max-batch > 1).",
            m,
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused before queueing, by reason.",
            ["model_name", "reason"],
            registry=registry,
        )
        self.cancelled = Counter(
            PREFIX + "requests_cancelled",
            "Requests whose client left, by where they were.",
            ["model_name", "stage"],
            registry=registry,
        )
        self.failed = Counter(
            PREFIX + "requests_failed",
            "Requests that ended in an error after queueing, by reason.",
            ["model_name", "reason"],
            registry=registry,
        )
        for gauge in (self.waiting, self.running):
            gauge.labels(model_name).set(0)

    def record_generation(self, stats: GenerationStats, queue_seconds: float, ttft: float | None, e2e: float) -> None:
        """One finished (or cut, or abandoned) generation's speculation and latency figures."""
        model = self.model
        for source, (rounds, drafted, accepted) in stats.by_source.items():
            self.drafts.labels(model, source).inc(rounds)
            self.draft_tokens.labels(model, source).inc(drafted)
            self.accepted_tokens.labels(model, source).inc(accepted)
        for pos, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
            self.drafted_per_pos.labels(model, str(pos)).inc(drafted)
            self.accepted_per_pos.labels(model, str(pos)).inc(accepted)
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.prefix_queries.labels(model).inc(stats.prompt_tokens)
        self.prefix_hits.labels(model).inc(stats.cached_tokens)
        self.generation_tokens.labels(model).inc(stats.new_tokens)
        self.queue_time.labels(model).observe(queue_seconds)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if stats.new_tokens > 1:
            decode = stats.total_seconds - stats.prefill_seconds
            self.tpot.labels(model).observe(max(0.0, decode) / (stats.new_tokens - 1))
        self.e2e.labels(model).observe(e2e)

    def watch_prefix_cache(self, describe) -> None:
        """Gauges of the generator's prefix pool, read at each scrape: describe() ->
        prefix_pool.PrefixPool.describe()'s dict (counts only, safe from this thread)."""
        for key, what in PREFIX_GAUGES.items():
            gauge = Gauge(PREFIX + "prefix_cache_" + key, what, ["model_name"], registry=self.registry)
            gauge.labels(self.model).set_function(lambda key=key: describe()[key])

    def observe_batch(self, sequences: int) -> None:
        """One round of the batch scheduler served `sequences` running requests."""
        self.batch_size.labels(self.model).observe(sequences)

    def render(self) -> bytes:
        return generate_latest(self.registry)
