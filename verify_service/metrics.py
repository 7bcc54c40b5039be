"""Prometheus /metrics of the verify service (``--metrics-port``).

Two kinds of series, neither of which makes the engine wait:
- latency histograms, observed where the latency is measured: the engine step by the engine
  thread, the draft link's control-plane overhead by RemoteDraft (one cheap ``observe`` each);
- everything else from the ``VerifyStats`` snapshot GetMetrics serves too, read at each scrape
  on the engine thread between two steps (the scrape waits for the step in progress, at most
  ``SCRAPE_TIMEOUT_S``; a scrape that times out carries the histograms only).
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable

from common.metrics_http import MetricsEndpoint, prometheus_client, serve_metrics
from verify_service.stats import VerifyStats

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 5.0
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OVERHEAD_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class VerifyMetrics:
    """The service's own registry, served on ``host:port`` from the moment it is built."""

    def __init__(self, host: str, port: int):
        prom = prometheus_client()
        self.registry = prom.CollectorRegistry()
        self.step_seconds = prom.Histogram(
            "eagle3_verify_step_seconds", "Engine step latency: one batched forward, commit and draft round trip",
            buckets=STEP_BUCKETS_S, registry=self.registry)
        self.draft_overhead_seconds = prom.Histogram(
            "eagle3_verify_draft_link_overhead_seconds",
            "Draft link control-plane overhead per step: round trip minus the draft's compute",
            buckets=OVERHEAD_BUCKETS_S, registry=self.registry)
        prom.GCCollector(registry=self.registry)  # python_gc_*: collections per generation (the heap is frozen)
        self.endpoint: MetricsEndpoint = serve_metrics(self.registry, host, port)

    def attach(self, read: Callable[[float], VerifyStats]) -> None:
        """Report ``read(timeout_s)``'s snapshot at every scrape (once the engine thread exists)."""
        self.registry.register(_StatsCollector(read))

    def stop(self) -> None:
        self.endpoint.stop()


class _StatsCollector:
    def __init__(self, read: Callable[[float], VerifyStats]):
        self.read = read

    def collect(self):
        try:
            stats = self.read(SCRAPE_TIMEOUT_S)
        except futures.TimeoutError:
            log.warning("metrics scrape: no answer from the engine thread in %.0f s", SCRAPE_TIMEOUT_S)
            return
        yield from families(stats)


def families(s: VerifyStats) -> list:
    """The snapshot as Prometheus metric families (counters get ``_total`` when exposed)."""
    core = prometheus_client().metrics_core
    counter = lambda name, doc, value: core.CounterMetricFamily(f"eagle3_verify_{name}", doc, value=value)  # noqa: E731
    gauge = lambda name, doc, value: core.GaugeMetricFamily(f"eagle3_verify_{name}", doc, value=value)  # noqa: E731
    spec = s.speculation
    steps = core.CounterMetricFamily("eagle3_verify_engine_steps", "Engine steps, by whether they verified a tree",
                                     labels=["kind"])
    steps.add_metric(["speculative"], s.speculative_steps)
    steps.add_metric(["plain"], s.plain_steps)
    by_depth = core.CounterMetricFamily("eagle3_verify_accepted_tokens_by_depth",
                                        "Draft tokens accepted at tree depth d (1 = first draft token)",
                                        labels=["depth"])
    for depth, n in enumerate(spec.accepted_per_depth, 1):
        by_depth.add_metric([str(depth)], n)
    return _adaptive(s, core) + [
        counter("requests_completed", "Requests finished (stop or length)", s.completed_requests),
        counter("chained_steps", "Steps whose draft work went in behind acceptance on the device", s.chained_steps),
        counter("decode_steps_ahead", "Plain decode steps launched before the last step's tokens reached the host",
                s.decode_steps_ahead),
        counter("requests_cancelled", "Requests cancelled by the client or their deadline", s.cancelled_requests),
        gauge("requests_running", "Requests admitted and generating", s.running_requests),
        gauge("requests_waiting", "Requests queued for KV space or a batch slot", s.waiting_requests),
        counter("generated_tokens", "Tokens committed to requests", s.generated_tokens),
        steps,
        counter("trees_verified", "Candidate trees verified (one per sequence per speculative step)", spec.steps),
        counter("draft_tokens", "Draft tree nodes verified", spec.draft_tokens),
        counter("accepted_tokens", "Draft tree nodes accepted", spec.accepted_tokens),
        by_depth,
        gauge("speculation_tau", "Tokens committed per verified tree, bonus included, since start", spec.tau),
        gauge("speculation_acceptance_rate", "Accepted / verified draft tokens since start", spec.acceptance_rate),
        gauge("kv_blocks_used", "KV cache blocks reserved by requests", s.kv_blocks_used),
        gauge("kv_blocks_capacity", "KV cache blocks in all", s.kv_blocks_total),
        gauge("draft_connected", "1 while a draft service holds a session", int(s.draft_connected)),
        counter("draft_sessions", "Draft sessions opened (a reconnect opens a new one)", s.draft_sessions),
        counter("draft_errors", "Refused trees, draft timeouts and lost sessions", s.draft_errors),
    ]


def _adaptive(s: VerifyStats, core) -> list:
    """Adaptive speculation's choices (none when the tree is fixed)."""
    if not s.adaptive_speculation:
        return []
    decisions = core.CounterMetricFamily("eagle3_verify_adaptive_decisions",
                                         "Steps by the tree size adaptive speculation chose (0: plain decoding)",
                                         labels=["tree_nodes"])
    for nodes, n in sorted(s.adaptive_decisions.items()):
        decisions.add_metric([str(nodes)], n)
    current = core.GaugeMetricFamily("eagle3_verify_adaptive_tree_nodes",
                                     "Adaptive speculation's latest choice: nodes per tree (0: plain decoding)",
                                     value=s.adaptive_tree_nodes)
    detached = core.CounterMetricFamily("eagle3_verify_requests_without_draft",
                                        "Requests that started where trees did not pay at their batch: run "
                                        "without the draft", value=s.detached_requests)
    left = core.CounterMetricFamily("eagle3_verify_requests_left_draft",
                                    "Running requests that left the draft where plain decoding was chosen and "
                                    "trees did not pay at their batch", value=s.left_draft_requests)
    return [decisions, current, detached, left]
