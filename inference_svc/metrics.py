"""Prometheus metrics of one service instance (its own registry: no globals)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from snapshot_svc.clientlib import metrics_http

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATES = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("warmslot_requests", "gRPC requests by method and status code",
                                ["method", "code"], registry=r)
        self.tokens = Counter(
            "warmslot_tokens",
            "Tokens by kind: prompt (processed), cached (reused), predicted, drafted, "
            "accepted, draft_prefill", ["kind"], registry=r)
        self.prompt_seconds = Histogram("warmslot_prompt_seconds",
                                        "Time to process a request's prompt", buckets=_SECONDS,
                                        registry=r)
        self.prompt_speed = Histogram("warmslot_prompt_tokens_per_second",
                                      "Prompt processing speed per request", buckets=_RATES,
                                      registry=r)
        self.decode_speed = Histogram("warmslot_decode_tokens_per_second",
                                      "Decoding speed per request", buckets=_RATES, registry=r)
        self.slots_busy = Gauge("warmslot_slots_busy", "Slots serving a request", registry=r)
        self.queue_depth = Gauge("warmslot_queue_depth", "Requests waiting for a slot",
                                 registry=r)
        self.saves = Counter("warmslot_slot_saves", "SaveSlot calls by result", ["result"],
                             registry=r)
        self.save_seconds = Histogram("warmslot_slot_save_seconds", "SaveSlot latency",
                                      buckets=_SECONDS, registry=r)
        self.save_bytes = Counter("warmslot_slot_save_bytes", "Bytes written by SaveSlot",
                                  registry=r)
        self.restores = Counter("warmslot_slot_restores",
                                "RestoreSlot calls by result and draft policy applied",
                                ["result", "draft_policy"], registry=r)
        self.restore_seconds = Histogram("warmslot_slot_restore_seconds", "RestoreSlot latency",
                                         buckets=_SECONDS, registry=r)
        self.restore_bytes = Counter("warmslot_slot_restore_bytes", "Bytes read by RestoreSlot",
                                     registry=r)
        self.sessions = Gauge("warmslot_sessions",
                              "Sessions by the tier of their newest state: slot, ram, store "
                              "(the store: those this replica wrote, read or found at start)",
                              ["tier"], registry=r)
        self.session_evictions = Counter(
            "warmslot_session_evictions",
            "Sessions moved down a tier: slot_to_ram, ram_to_store, dropped (RAM tier full, "
            "no store)", ["kind"], registry=r)
        self.session_store_writes = Counter(
            "warmslot_session_store_writes",
            "Session writes to the store beside evictions: write_through (a turn's end "
            "state), conflict (refused: another replica had moved the session on)",
            ["kind"], registry=r)
        self.session_restores = Counter("warmslot_session_restores",
                                        "Sessions brought into a slot, by the tier they were in",
                                        ["tier"], registry=r)
        self.session_restore_seconds = Histogram(
            "warmslot_session_restore_seconds",
            "Bringing a session into a slot (the store's read and checks included), by tier",
            ["tier"], buckets=_SECONDS, registry=r)

    def serve(self, host: str, port: int, **security: Any) -> tuple[int, Callable[[], None]]:
        """Starts the HTTP endpoint (metrics_http.serve: TLS and keys as the service's);
        returns its port and a function that stops it."""
        return metrics_http.serve(self.registry, host, port, **security)
