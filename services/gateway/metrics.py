"""Prometheus metrics of one gateway app (its own registry, so several apps can live in one process)."""

import time
from collections import deque
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from services.gateway.store import ClusterView
from shared.speculative import ACCEPTANCE_BUCKETS, ACCEPTANCE_COUNTERS

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)


class RecentLatencies:
    """This gateway's time to first token and time per output token over the last minute, for the
    dashboard (Prometheus histograms are cumulative)."""

    WINDOW_SECONDS = 60.0

    def __init__(self) -> None:
        self._samples: dict[str, deque[tuple[float, float]]] = {"ttft": deque(), "tpot": deque()}

    def note(self, kind: str, seconds: float) -> None:
        self._samples[kind].append((time.monotonic(), seconds))

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per kind: count, p50 and p90 in seconds over the window."""
        horizon = time.monotonic() - self.WINDOW_SECONDS
        summary = {}
        for kind, samples in self._samples.items():
            while samples and samples[0][0] < horizon:
                samples.popleft()
            values = sorted(seconds for _, seconds in samples)
            summary[kind] = {"count": len(values),
                             "p50": values[len(values) // 2] if values else 0.0,
                             "p90": values[min(len(values) - 1, int(len(values) * 0.9))] if values else 0.0}
        return summary


class GatewayMetrics:
    def __init__(self) -> None:
        self.recent = RecentLatencies()
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "iterserve_gateway_requests",
            "Generation requests by outcome: a finish reason, client_disconnected, or an HTTP error status",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            "iterserve_gateway_refusals",
            "Error answers of every endpoint by HTTP status and error code (401 no key, 429 busy, ...)",
            ["status", "code"],
            registry=registry,
        )
        self.prompt_tokens = Counter("iterserve_gateway_prompt_tokens", "Prompt tokens accepted", registry=registry)
        self.unreplicated_acceptances = Counter(
            "iterserve_gateway_acceptance_unreplicated", "Requests accepted before --redis-wait-replicas replicas "
            "held them (within --redis-wait-ms): a Redis failover then could lose them", registry=registry)
        self.completion_tokens = Counter(
            "iterserve_gateway_completion_tokens", "Output tokens delivered", registry=registry
        )
        self.time_to_first_token = Histogram(
            "iterserve_gateway_time_to_first_token_seconds",
            "From request arrival to its first output token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "iterserve_gateway_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            buckets=TOKEN_TIME_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "iterserve_gateway_e2e_request_latency_seconds",
            "From request arrival to its final token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "iterserve_gateway_requests_in_flight", "Generation requests this gateway is answering", registry=registry
        )
        # Read from the heartbeat keys at each scrape.
        self.waiting = Gauge("iterserve_scheduler_waiting_requests", "Requests waiting", ["model"], registry=registry)
        self.running = Gauge("iterserve_scheduler_running_requests", "Requests running", ["model"], registry=registry)
        self.live_workers = Gauge("iterserve_live_workers", "Workers whose heartbeat key exists", ["model"],
                                  registry=registry)
        # Every worker metric says which executor made it (emulated: a hardware profile's numbers).
        self.kv_blocks_free = Gauge(
            "iterserve_worker_kv_blocks_free", "Free KV blocks per worker", ["worker_id", "executor"], registry=registry
        )
        self.kv_blocks_cached = Gauge(
            "iterserve_worker_kv_blocks_cached", "KV blocks per worker held by no request, kept in the prefix "
            "cache until evicted", ["worker_id", "executor"], registry=registry
        )
        # The scheduler's counters (read from its heartbeat), as vLLM's prefix_cache_queries/hits.
        self.prefix_cache_queries = Gauge(
            "iterserve_prefix_cache_queries_tokens", "Tokens looked up in the prefix cache at admissions, since the "
            "scheduler started", ["model"], registry=registry)
        self.prefix_cache_hits = Gauge(
            "iterserve_prefix_cache_hits_tokens", "Of them, tokens found cached, since the scheduler started",
            ["model"], registry=registry)
        self.prefix_cache_mismatches = Gauge(
            "iterserve_prefix_cache_mismatches", "Results whose worker's prefix cache did not hold what the "
            "scheduler's copy of it holds (that worker's cache started over), since the scheduler started",
            ["model"], registry=registry)
        self.busy_seconds = Gauge(
            "iterserve_worker_busy_seconds", "Seconds each worker spent inside steps since it started (emulated "
            "workers: the profile's step times)", ["worker_id", "executor"], registry=registry
        )
        self.scheduler_leases = Gauge(
            "iterserve_scheduler_leased_workers", "Workers each of a model's several schedulers holds a lease on "
            "(--schedulers N)", ["model", "scheduler_id"], registry=registry)
        self.redis_up = Gauge("iterserve_gateway_redis_up", "1 when Redis answered the last scrape", registry=registry)
        self.vllm = VllmMetrics(registry)

    def observe_cluster(self, views: "list[tuple[str, ClusterView]] | None") -> None:
        """Refresh the gauges read from heartbeat keys, per model (None: Redis did not answer)."""
        self.redis_up.set(0 if views is None else 1)
        if views is None:
            return
        for gauge in (self.waiting, self.running, self.live_workers, self.kv_blocks_free, self.kv_blocks_cached,
                      self.busy_seconds, self.prefix_cache_queries, self.prefix_cache_hits,
                      self.prefix_cache_mismatches, self.scheduler_leases, self.vllm.running, self.vllm.waiting, self.vllm.kv_cache_usage):
            gauge.clear()
        for model, view in views:
            self.waiting.labels(model).set(view.scheduler.waiting if view.scheduler else 0)
            self.running.labels(model).set(view.scheduler.running if view.scheduler else 0)
            self.live_workers.labels(model).set(len(view.live_worker_ids))
            if view.scheduler:
                self.prefix_cache_queries.labels(model).set(view.scheduler.prefix_cache_queried_tokens)
                self.prefix_cache_hits.labels(model).set(view.scheduler.prefix_cache_hit_tokens)
                self.prefix_cache_mismatches.labels(model).set(view.scheduler.prefix_cache_mismatches)
            self.vllm.observe_cluster(model, view)
            for info in view.schedulers:
                if info.scheduler_id:
                    self.scheduler_leases.labels(model, info.scheduler_id).set(len(info.leases))
            for worker in view.workers:
                self.kv_blocks_free.labels(worker.worker_id, worker.executor).set(worker.kv_blocks_free)
                self.kv_blocks_cached.labels(worker.worker_id, worker.executor).set(worker.kv_blocks_cached)
                self.busy_seconds.labels(worker.worker_id, worker.executor).set(worker.busy_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmMetrics:
    """The series routers and autoscalers read from vLLM, under vLLM's names and its `model_name` label,
    beside iterserve's own: the queue, KV use, latencies, tokens and the prefix cache's counters (these
    from the scheduler's totals in Redis, which survive its restarts: services/scheduler/service.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        label = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests running (holding KV on a worker)", label,
                             registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", label, registry=registry)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use",
                                    label, registry=registry)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds", "Time to the first token", label,
                                             buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds", "Time between two output tokens",
                                             label, buckets=TOKEN_TIME_BUCKETS, registry=registry)
        self.e2e_request_latency = Histogram("vllm:e2e_request_latency_seconds", "From arrival to the last token",
                                             label, buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens accepted", label, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens delivered", label, registry=registry)
        self._series: dict[str, VllmSeries] = {}
        # The scheduler's totals, as last read from Redis (they outlive its restarts): counters whose
        # values come from outside this process, so a collector of their own.
        self.lasting: dict[str, dict[str, int]] = {}  # model -> counter -> total
        registry.register(_LastingCounters(self.lasting))

    def of(self, model: str) -> "VllmSeries":
        """A model's request series, labelled once (a token's observation looks up no label)."""
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = VllmSeries(
                self.time_to_first_token.labels(model), self.inter_token_latency.labels(model),
                self.e2e_request_latency.labels(model), self.prompt_tokens.labels(model),
                self.generation_tokens.labels(model))
        return series

    def observe_cluster(self, model: str, view: ClusterView) -> None:
        if view.scheduler:
            self.running.labels(model).set(view.scheduler.running)
            self.waiting.labels(model).set(view.scheduler.waiting)
        total = sum(worker.kv_blocks_total for worker in view.workers)
        unused = sum(worker.kv_blocks_free + worker.kv_blocks_cached for worker in view.workers)
        self.kv_cache_usage.labels(model).set((total - unused) / total if total else 0.0)
        self.lasting[model] = dict(view.counters)


class VllmSeries(NamedTuple):
    """One model's children of VllmMetrics' request series."""

    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter


class _LastingCounters:
    """vLLM's prefix-cache counters, from the scheduler's totals in Redis (services/scheduler/service.py
    COUNTERS), as counters."""

    SERIES = (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
               "prefix_cache_queried_tokens"),
              ("vllm:prefix_cache_hits", "Of them, tokens found cached", "prefix_cache_hit_tokens"),
              ("vllm:spec_decode_num_drafts", "Speculative decoding: items that verified proposed tokens",
               "spec_drafts"),
              ("vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed", "spec_draft_tokens"),
              ("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens kept",
               "spec_accepted_tokens"))

    def __init__(self, lasting: dict[str, dict[str, int]]) -> None:
        self.lasting = lasting

    ACCEPTANCE = ("iterserve:spec_decode_request_acceptance_rate",
                  "Speculative decoding: per request that verified proposals, the share of them kept (at its end)")

    def collect(self):
        for name, documentation, field in self.SERIES:
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            for model, counters in self.lasting.items():
                family.add_metric([model], counters.get(field, 0))
            yield family
        family = HistogramMetricFamily(*self.ACCEPTANCE, labels=["model_name"])
        for model, counters in self.lasting.items():
            cumulative, buckets = 0, []
            for bound, name in zip(ACCEPTANCE_BUCKETS, ACCEPTANCE_COUNTERS):
                cumulative += counters.get(name, 0)
                buckets.append((f"{bound:g}", cumulative))
            buckets.append(("+Inf", counters.get("spec_requests", 0)))
            family.add_metric([model], buckets, counters.get("spec_request_acceptance_permille_sum", 0) / 1000)
        yield family

    def describe(self):
        return [*(CounterMetricFamily(name, documentation, labels=["model_name"])
                  for name, documentation, _ in self.SERIES),
                HistogramMetricFamily(*self.ACCEPTANCE, labels=["model_name"])]
