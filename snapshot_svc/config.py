"""Server configuration: one frozen object built from flags, each flag also read
from an environment variable `WARMSLOT_SNAPSHOT_<FLAG>` (flags win), e.g.
`--data-dir` <- WARMSLOT_SNAPSHOT_DATA_DIR, `--max-snapshot-bytes` <-
WARMSLOT_SNAPSHOT_MAX_SNAPSHOT_BYTES.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from snapshot_svc.client.contract import PROTOCOL_MAX, PROTOCOL_MIN
from snapshot_svc.clientlib import settings, tls

ENV_PREFIX = "WARMSLOT_SNAPSHOT_"
DEFAULT_PORT = 50052
_UNITS = MappingProxyType({"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40})


def parse_size(text: str) -> int:
    """Bytes from '1048576', '512M', '512MiB', '2G' (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512M, 2GiB)")
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class SnapshotConfig:
    data_dir: Path | None = None  # the local backend's directory (or `store`)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: any free port (the "serving" log line says which)
    max_protocol: int = PROTOCOL_MAX  # 1: behave exactly as a protocol-1 server
    max_snapshot_bytes: int = 2 << 30  # per part
    spare_bytes: int = 1 << 30  # deleted blobs' files kept for Puts to overwrite; 0 = none
    metrics_port: int = 0  # Prometheus HTTP endpoint; 0: off
    metrics_host: str = "127.0.0.1"  # its address (metrics_http: TLS and keys as gRPC's)
    workers: int = 32  # threads serving calls (a stream holds one while it runs)
    grace_s: float = 10.0  # on SIGTERM/SIGINT, how long in-flight calls may finish
    stage_ttl_s: float = 300.0  # how long a staged target waits for its draft
    log_level: str = "info"
    store: str = ""  # s3://bucket[/prefix]: the S3 backend instead of data_dir
    s3_endpoint: str = ""  # e.g. http://127.0.0.1:8333; empty: the AWS default
    s3_region: str = ""  # empty: us-east-1 (or AWS_DEFAULT_REGION... through boto3)
    replica_id: str = ""  # names this replica's uploads in the bucket; empty: the host name
    gc_grace_s: float = 3600.0  # S3: unreferenced objects younger than this are kept
    # security: API keys with namespaces (clientlib.auth) and TLS
    api_keys: Path | None = None
    insecure: bool = False  # serve a non-loopback address with neither keys nor TLS
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients need a certificate it signed (mTLS)
    # limits that keep one client from starving the others (limits.py)
    stream_idle_timeout_s: float = 30.0  # a Put sending nothing this long is cancelled
    max_streams_per_key: int = 8  # Put/Get streams at once per key / keyless host (< workers)
    stream_wait_s: float = 30.0  # a Put/Get beyond that waits this long for a place; 0: refused
    max_unary_per_key: int = 8  # other calls at once per key (+ streams < workers)
    quota_bytes: int = 0  # stored bytes per key namespace; 0 = no quota

    def __post_init__(self) -> None:
        if (self.data_dir is None) == (not self.store):
            raise ValueError("give either a data directory (--data-dir) or --store "
                             "s3://bucket/prefix, not both")
        if self.store and not self.store.startswith("s3://"):
            raise ValueError(f"--store must be s3://bucket[/prefix], got {self.store!r}")
        if self.gc_grace_s <= 0:
            raise ValueError("gc_grace_s must be > 0")
        if not PROTOCOL_MIN <= self.max_protocol <= PROTOCOL_MAX:
            raise ValueError(f"max_protocol must be in {PROTOCOL_MIN}..{PROTOCOL_MAX}")
        if self.max_snapshot_bytes <= 0 or self.workers <= 0 or self.grace_s < 0:
            raise ValueError("max_snapshot_bytes and workers must be positive, grace_s >= 0")
        if self.spare_bytes < 0:
            raise ValueError("spare_bytes must be >= 0")
        if self.stream_idle_timeout_s <= 0 or self.quota_bytes < 0:
            raise ValueError("--stream-idle-timeout must be > 0 and --quota-bytes >= 0")
        if self.stream_wait_s < 0:
            raise ValueError("--stream-wait must be >= 0")
        if not 0 < self.max_streams_per_key < self.workers:
            raise ValueError(f"--max-streams-per-key must be in 1..{self.workers - 1} (fewer "
                             "than --workers, so that other keys always find a thread)")
        if self.api_keys is not None and not (
                0 < self.max_unary_per_key < self.workers - self.max_streams_per_key):
            raise ValueError("--max-unary-per-key must be >= 1 and, with "
                             "--max-streams-per-key, below --workers")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        tls.check_exposure(self.host, self.api_keys, self.tls_cert is not None, self.insecure)
        if self.metrics_port:
            tls.check_exposure(self.metrics_host, self.api_keys, self.tls_cert is not None,
                               self.insecure, risk=tls.METRICS_RISK)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The service's flags (`env` is read by parse_config, through settings.parse)."""
    p = argparse.ArgumentParser(prog="python -m snapshot_svc",
                                description="Warmslot snapshot service (gRPC)")
    f = settings.field_flags(p, SnapshotConfig)
    f("--data-dir", "directory holding the snapshots (the local backend; or --store)", type=Path)
    f("--store",
      "s3://bucket[/prefix]: keep the snapshots in an S3 bucket instead of --data-dir, which is "
      "then ignored (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
      "AWS_SHARED_CREDENTIALS_FILE)")
    f("--s3-endpoint", "URL of the S3 API (SeaweedFS, Ceph RGW, MinIO...); empty: AWS")
    f("--s3-region", "S3 region (empty: us-east-1)")
    f("--replica-id",
      "this replica's name in the bucket, unique per replica (empty: the host name)")
    f("--gc-grace", "S3: seconds an unreferenced object is kept before garbage collection",
      field="gc_grace_s")
    f("--host", "address to listen on")
    f("--port", "gRPC port; 0 picks a free one")
    f("--max-protocol", "highest protocol version spoken; 1 = target files only, as an old server",
      choices=range(PROTOCOL_MIN, PROTOCOL_MAX + 1))
    f("--max-snapshot-bytes", "largest part stored (bytes, or 512M, 2G...)", type=parse_size)
    f("--spare-bytes",
      "disk space kept in files of deleted snapshots for new Puts to overwrite (faster than new "
      "files; given back when the disk is full); 0 = off", type=parse_size)
    f("--metrics-port", "Prometheus metrics port; 0 = off")
    f("--metrics-host",
      "address of the metrics endpoint; with TLS it speaks HTTPS (client certificates as "
      "--tls-client-ca), with --api-keys it needs 'Authorization: Bearer <admin key>'; a "
      "non-loopback address needs one of them or --insecure")
    f("--workers", "threads serving calls; more calls wait")
    f("--grace", "seconds in-flight calls get on shutdown", field="grace_s")
    f("--stage-ttl", "seconds a staged target waits for its draft", field="stage_ttl_s")
    f("--log-level", "debug, info, warning or error")
    f("--api-keys",
      "file of API keys, one '<key> namespace=NAME|admin' per line (reloaded on SIGHUP)")
    f("--insecure", "allow a non-loopback --host with neither --api-keys nor TLS",
      action="store_true")
    f("--tls-cert", "TLS certificate (PEM)")
    f("--tls-key", "TLS private key (PEM)")
    f("--tls-client-ca", "CA (PEM) whose client certificates are required (mutual TLS)")
    f("--stream-idle-timeout",
      "seconds a Put may send nothing before it is cancelled (its space freed)",
      field="stream_idle_timeout_s")
    f("--max-streams-per-key",
      "Put/Get streams one API key (without keys: one client host) may have open at once; "
      "more wait (--stream-wait)")
    f("--stream-wait",
      "seconds a Put/Get beyond --max-streams-per-key waits for a free stream, within its "
      "deadline (RESOURCE_EXHAUSTED after); at most --max-streams-per-key calls of one "
      "caller wait (fewer if --workers is small); 0 = refuse at once",
      field="stream_wait_s")
    f("--max-unary-per-key",
      "with --api-keys: unary calls (Hello, List, Stat, Delete) one key may have running at "
      "once (RESOURCE_EXHAUSTED beyond)")
    f("--quota-bytes",
      "bytes a namespaced key's snapshots may hold (RESOURCE_EXHAUSTED beyond); 0 = off",
      type=parse_size)
    settings.document_env(p, ENV_PREFIX)
    return p


def parse_config(argv: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None) -> SnapshotConfig:
    env = os.environ if env is None else env
    parser = build_parser(env)
    a = settings.parse(parser, argv if argv is not None else sys.argv[1:], env, ENV_PREFIX)
    if a.data_dir is None and not a.store:
        parser.error(f"--data-dir (or {ENV_PREFIX}DATA_DIR) or --store is required")
    values = settings.field_values(a, SnapshotConfig)
    if a.store:  # --store wins over a data dir (the container image sets one by default)
        values["data_dir"] = None
    try:
        return SnapshotConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
