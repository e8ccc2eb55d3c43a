"""Prometheus metrics of the daemon (one registry per daemon, served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The daemon's counters.  Updated from the event loop and from writer threads
    (prometheus_client metrics are thread-safe)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.bytes_staged = Counter(
            "ckptd_bytes_staged", "Bytes handed over to the daemon by Save/SaveStream", registry=r)
        self.bytes_written = Counter(
            "ckptd_bytes_written", "Bytes of chunks written to storage", registry=r)
        self.save_latency = Histogram(
            "ckptd_save_latency_seconds",
            "Seconds from a rank's Save being accepted to its step being committed",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.write_latency = Histogram(
            "ckptd_write_seconds", "Seconds to write one rank's chunks and manifest",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.queue_depth = Gauge(
            "ckptd_queue_depth", "Saves accepted whose bytes are not yet durable", registry=r)
        self.save_failures = Counter(
            "ckptd_save_failures", "Rank saves that failed (will not commit)", registry=r)
        self.saves = Counter(
            "ckptd_saves", "Rank saves by final state", ["state"], registry=r)
        self.staging_in_use = Gauge(
            "ckptd_staging_bytes_in_use", "Staging budget bytes taken by segments and streams",
            registry=r)
        self.staging_budget = Gauge(
            "ckptd_staging_bytes_budget", "The node-wide staging budget (--staging-bytes)",
            registry=r)
        self.bytes_read = Counter(
            "ckptd_bytes_read", "Object bytes served to loads, by transfer: shared_memory "
            "(ReadIntoSegment) or stream (ReadObject)", ["transfer"], registry=r)
        self.reads_in_flight = Gauge(
            "ckptd_read_ranges_in_flight", "Ranges of ReadIntoSegment calls being read now",
            registry=r)
        self.sessions = Gauge("ckptd_sessions", "Registered client sessions", registry=r)
        self.segments = Gauge("ckptd_staging_segments", "Live staging segments", registry=r)


def serve_metrics(metrics: Metrics, port: int, addr: str = "0.0.0.0") -> object:
    """Start the /metrics HTTP server in a background thread; returns the server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
    return server
