"""Prometheus metrics of one server, in a registry of its own (no global state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from snapshot_svc.spares import SparePool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, usage: Callable[[], tuple[int, int]], spares: SparePool | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.puts = Counter("warmslot_snapshot_puts", "Put calls by part and status code",
                            ["part", "code"], registry=r)
        self.gets = Counter("warmslot_snapshot_gets", "Get calls by part and status code",
                            ["part", "code"], registry=r)
        self.bytes_received = Counter("warmslot_snapshot_received_bytes",
                                      "Data bytes received by Put", ["part"], registry=r)
        self.bytes_sent = Counter("warmslot_snapshot_sent_bytes", "Data bytes sent by Get",
                                  ["part"], registry=r)
        self.digest_failures = Counter("warmslot_snapshot_digest_failures",
                                       "Puts refused, or Gets ended, for a size or SHA-256 "
                                       "mismatch", registry=r)
        self.rpcs = Counter("warmslot_snapshot_rpcs", "Calls by method and status code",
                            ["method", "code"], registry=r)
        self.put_seconds = Histogram("warmslot_snapshot_put_seconds",
                                     "Put latency, first message to commit", ["part"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.get_seconds = Histogram("warmslot_snapshot_get_seconds",
                                     "Get latency, request to last chunk", ["part"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        snapshots = Gauge("warmslot_snapshot_stored_snapshots", "Committed snapshots",
                          registry=r)
        snapshots.set_function(lambda: usage()[0])
        stored = Gauge("warmslot_snapshot_stored_bytes", "Bytes held by stored parts",
                       registry=r)
        stored.set_function(lambda: usage()[1])
        spare = Gauge("warmslot_snapshot_spare_bytes",
                      "Bytes of spare files kept for the next Puts to overwrite", registry=r)
        spare.set_function(lambda: spares.bytes if spares is not None else 0)
        reused = Gauge("warmslot_snapshot_spares_reused",
                       "Puts that overwrote a spare file since start", registry=r)
        reused.set_function(lambda: spares.reused if spares is not None else 0)
