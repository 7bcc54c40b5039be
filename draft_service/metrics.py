"""Prometheus /metrics of the draft service (``--metrics-port``).

The worker thread keeps plain counters (steps, trees, sessions, connected) that a scrape reads
as they are, without a lock; the draft compute time is a histogram the worker observes after
each step (one cheap ``observe``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.metrics_http import MetricsEndpoint, prometheus_client, serve_metrics

if TYPE_CHECKING:
    from draft_service.server import DraftWorker

COMPUTE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DraftMetrics:
    """The service's own registry, served on ``host:port`` from the moment it is built."""

    def __init__(self, host: str, port: int):
        prom = prometheus_client()
        self.registry = prom.CollectorRegistry()
        self.compute_seconds = prom.Histogram(
            "eagle3_draft_compute_seconds", "Draft compute per step: draft extend and tree growth",
            buckets=COMPUTE_BUCKETS_S, registry=self.registry)
        prom.GCCollector(registry=self.registry)  # python_gc_*: collections per generation (the heap is frozen)
        self.endpoint: MetricsEndpoint = serve_metrics(self.registry, host, port)

    def attach(self, worker: DraftWorker) -> None:
        """Report ``worker``'s counters at every scrape."""
        self.registry.register(_WorkerCollector(worker))

    def stop(self) -> None:
        self.endpoint.stop()


class _WorkerCollector:
    def __init__(self, worker: DraftWorker):
        self.worker = worker

    def collect(self):
        core = prometheus_client().metrics_core
        w = self.worker
        yield core.GaugeMetricFamily("eagle3_draft_connected", "1 while a session with the verify service is live",
                                     value=int(w.connected))
        yield core.CounterMetricFamily("eagle3_draft_steps", "Verify steps answered", value=w.steps)
        yield core.CounterMetricFamily("eagle3_draft_trees", "Candidate trees proposed", value=w.trees_proposed)
        yield core.CounterMetricFamily("eagle3_draft_reconnects", "Sessions opened after an earlier one ended",
                                       value=max(0, w.sessions_opened - 1))
