"""Prometheus metrics for `/metrics`, on a registry of their own (one per app, so tests can build many)."""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hf2q.server.spec_metrics import SpecMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hf2q_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("hf2q_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("hf2q_cached_prompt_tokens", "Prompt tokens restored from a cache",
                                     registry=r)
        self.generation_tokens = Counter("hf2q_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("hf2q_request_finished", "Generations finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("hf2q_time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hf2q_inter_token_latency_seconds", "Time between consecutive output deltas",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hf2q_request_latency_seconds", "Time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_seqs = Histogram("hf2q_batch_size_sequences", "Sequences in one engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_tokens = Histogram("hf2q_batch_size_tokens", "Tokens in one engine step",
                                      buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384), registry=r)
        self.queued_ahead = Counter("hf2q_decode_steps_queued_ahead",
                                    "Decode steps queued before the host read the step before (--async-scheduling)",
                                    registry=r)
        self._queued_ahead_seen = 0
        self.running = Gauge("hf2q_num_requests_running", "Requests holding a cache slot", registry=r)
        self.waiting = Gauge("hf2q_num_requests_waiting", "Requests queued for a slot", registry=r)
        self.kv_usage = Gauge("hf2q_kv_cache_usage_ratio", "Fraction of K/V cache blocks in use", registry=r)
        self.slot_usage = Gauge("hf2q_slot_usage_ratio", "Fraction of sequence slots in use", registry=r)
        self.prefix_hits = Counter("hf2q_prefix_cache_hits", "Admissions resumed from a retained prefix", registry=r)
        self.prefix_misses = Counter("hf2q_prefix_cache_misses", "Admissions with no retained prefix to resume",
                                     registry=r)
        self.prefix_tokens = Counter("hf2q_prefix_cache_reused_tokens", "Prompt tokens resumed, not computed",
                                     registry=r)
        self.prefix_evictions = Counter("hf2q_prefix_cache_evictions", "Retained prefixes evicted", registry=r)
        self.prefix_bytes = Gauge("hf2q_prefix_cache_bytes", "Bytes held by retained prefixes", registry=r)
        self.rerenders = Counter("hf2q_prefix_rerender_prefills",
                                 "Background prefills of a history as its next turn renders it, checkpointed",
                                 registry=r)
        self.rerender_tokens = Counter("hf2q_prefix_rerender_tokens", "Tokens those background prefills computed",
                                       registry=r)
        self.rerender_skipped = Counter("hf2q_prefix_rerender_skipped",
                                        "Re-rendered histories a checkpoint or a queued prefill already covered",
                                        registry=r)
        self.rerender_cancelled = Counter("hf2q_prefix_rerender_cancelled",
                                          "Background prefills cancelled for a user request's slot or room", registry=r)
        self.rerender_absorbed = Counter("hf2q_prefix_rerender_absorbed",
                                         "Queued background prefills whose next turn came first and computed "
                                         "their tokens itself", registry=r)
        self._prefix_seen = (0,) * 9
        self._prefix_lock = threading.Lock()  # the engine thread and /metrics scrapes both observe
        self.spec = SpecMetrics(r)
        info = Gauge("hf2q_model_info", "The served model (value is always 1)", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        from hf2q.kernels.tuning.late_compiles import WATCH
        Gauge("hf2q_kernels_built_after_warm_up", "Triton kernel variants built while serving (a request waited "
              "for each; the log names them)", registry=r).set_function(lambda: WATCH.count)
        Gauge("hf2q_kernel_build_seconds_after_warm_up", "Seconds spent building them", registry=r).set_function(
            lambda: WATCH.seconds)
        Gauge("hf2q_matvec_shapes_timed_after_warm_up", "Quantized mat-vec shapes whose configurations were timed "
              "on the GPU while serving (a request waited for each; the log names them)",
              registry=r).set_function(lambda: WATCH.timings)
        Gauge("hf2q_matvec_timing_seconds_after_warm_up", "Seconds spent timing them", registry=r).set_function(
            lambda: WATCH.timing_seconds)
        self.started = time.monotonic()
        Gauge("hf2q_uptime_seconds", "Seconds since the server started", registry=r).set_function(
            lambda: time.monotonic() - self.started)

    def observe_step(self, engine) -> None:
        """After an engine step: its batch size and the counters that step moved. The gauges are read at
        scrape time (observe_engine): refreshing them every step cost the engine thread about a tenth of its
        host time a step at 64 streams (the cache's byte counts), with the GIL held."""
        seqs, tokens = engine.last_batch
        if seqs:
            self.batch_seqs.observe(seqs)
            self.batch_tokens.observe(tokens)
        queued = getattr(engine, "steps_queued_ahead", 0)
        if queued > self._queued_ahead_seen:
            self.queued_ahead.inc(queued - self._queued_ahead_seen)
            self._queued_ahead_seen = queued
        spec = getattr(engine, "spec", None)
        if spec is not None:
            self.spec.observe(spec.stats)

    def observe_engine(self, engine) -> None:
        """Refresh the queue and cache gauges and the prefix cache's counters (at scrape time)."""
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        usage = engine.cache.usage()
        self.kv_usage.set(usage.kv_blocks_used / max(usage.kv_blocks_total, 1))
        self.slot_usage.set(usage.slots_used / max(usage.slots_total, 1))
        prefix = getattr(engine, "prefix", None)
        if prefix is not None:
            self._observe_prefix(prefix)

    def _observe_prefix(self, prefix) -> None:
        """The prefix cache keeps plain counts; the counters advance by what changed since last time."""
        st = prefix.stats
        now = (st.hits, st.misses, st.tokens_reused, st.evictions,
               st.rerenders, st.rerender_tokens, st.rerender_skipped, st.rerender_cancelled, st.rerender_absorbed)
        counters = (self.prefix_hits, self.prefix_misses, self.prefix_tokens, self.prefix_evictions,
                    self.rerenders, self.rerender_tokens, self.rerender_skipped, self.rerender_cancelled,
                    self.rerender_absorbed)
        with self._prefix_lock:
            for counter, new, old in zip(counters, now, self._prefix_seen):
                if new > old:
                    counter.inc(new - old)
            self._prefix_seen = tuple(max(a, b) for a, b in zip(now, self._prefix_seen))
        self.prefix_bytes.set(prefix.nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-generation latency bookkeeping: TTFT on the first token, inter-token gaps after."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(n)

    def done(self, prompt_tokens: int, cached_tokens: int, finish_reason: str | None) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
        self.metrics.finished.labels(finish_reason=finish_reason or "unknown").inc()
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
