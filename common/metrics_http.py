"""Prometheus ``/metrics`` for a service process (``--metrics-port``, the optional `metrics` extra).

Each service keeps its own ``CollectorRegistry``, never prometheus_client's global default one,
so two services (or tests) in one process do not mix their series. The registry is served by
prometheus_client's HTTP server on a daemon thread; a scrape runs on that server's threads.
prometheus_client is imported only when a service asks for metrics: without the flag the
services run without the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import AddressInUseError, MissingExtraError

INSTALL_HINT = "pip install 'eagle3-serve[metrics]'"


def prometheus_client():
    """The prometheus_client module; a one-line typed error naming the extra when it is missing."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingExtraError(f"--metrics-port needs prometheus-client, which is not installed: "
                                f"{INSTALL_HINT}") from exc
    return prometheus_client


def metrics_host(listen: str) -> str:
    """The host of a gRPC listen address (``host:port``, ``[v6]:port``); 127.0.0.1 for a unix socket."""
    if listen.startswith("unix"):
        return "127.0.0.1"
    host = listen.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return host or "127.0.0.1"


@dataclass
class MetricsEndpoint:
    """One registry served on ``http://host:port/metrics`` (``port``: the bound one, also for port 0)."""

    host: str
    port: int
    _server: object  # wsgiref's server, serving on its own daemon thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry, host: str, port: int) -> MetricsEndpoint:
    """Start serving ``registry`` on host:port (0: any free port); a taken port is a typed error."""
    try:
        server, _ = prometheus_client().start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise AddressInUseError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
    return MetricsEndpoint(host, server.server_port, server)
