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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from snapshot_svc import PROTOCOL_MAX, PROTOCOL_MIN
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
    max_streams_per_key: int = 8  # Put/Get streams at once per key (< workers)
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


def _path_or_none(value: str) -> Path | None:
    return None if value.strip().lower() in ("", "none") else Path(value)


def _flag(parser: argparse.ArgumentParser, env: Mapping[str, str], flag: str,
          conv: Callable[[str], Any], default: Any, help: str, **kw: Any) -> None:
    """One flag; its variable (settings.env_var) is applied by parse_config."""
    parser.add_argument(flag, type=conv, default=default, help=help, **kw)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m snapshot_svc",
                                description="Warmslot snapshot service (gRPC)")
    d = SnapshotConfig
    _flag(p, env, "--data-dir", Path, None,
          "directory holding the snapshots (the local backend; or --store)")
    _flag(p, env, "--store", str, d.store,
          "s3://bucket[/prefix]: keep the snapshots in an S3 bucket instead of --data-dir, "
          "which is then ignored (credentials "
          "from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_SHARED_CREDENTIALS_FILE)")
    _flag(p, env, "--s3-endpoint", str, d.s3_endpoint,
          "URL of the S3 API (SeaweedFS, Ceph RGW, MinIO...); empty: AWS")
    _flag(p, env, "--s3-region", str, d.s3_region, "S3 region (empty: us-east-1)")
    _flag(p, env, "--replica-id", str, d.replica_id,
          "this replica's name in the bucket, unique per replica (empty: the host name)")
    _flag(p, env, "--gc-grace", float, d.gc_grace_s,
          "S3: seconds an unreferenced object is kept before garbage collection")
    _flag(p, env, "--host", str, d.host, "address to listen on")
    _flag(p, env, "--port", int, d.port, "gRPC port; 0 picks a free one")
    _flag(p, env, "--max-protocol", int, d.max_protocol,
          "highest protocol version spoken; 1 = target files only, as an old server",
          choices=range(PROTOCOL_MIN, PROTOCOL_MAX + 1))
    _flag(p, env, "--max-snapshot-bytes", parse_size, d.max_snapshot_bytes,
          "largest part stored (bytes, or 512M, 2G...)")
    _flag(p, env, "--spare-bytes", parse_size, d.spare_bytes,
          "disk space kept in files of deleted snapshots for new Puts to overwrite "
          "(faster than new files; given back when the disk is full); 0 = off")
    _flag(p, env, "--metrics-port", int, d.metrics_port, "Prometheus metrics port; 0 = off")
    _flag(p, env, "--metrics-host", str, d.metrics_host,
          "address of the metrics endpoint; with TLS it speaks HTTPS (client certificates as "
          "--tls-client-ca), with --api-keys it needs 'Authorization: Bearer <admin key>'; "
          "a non-loopback address needs one of them or --insecure")
    _flag(p, env, "--workers", int, d.workers, "threads serving calls; more calls wait")
    _flag(p, env, "--grace", float, d.grace_s, "seconds in-flight calls get on shutdown")
    _flag(p, env, "--stage-ttl", float, d.stage_ttl_s,
          "seconds a staged target waits for its draft")
    _flag(p, env, "--log-level", str, d.log_level, "debug, info, warning or error")
    _flag(p, env, "--api-keys", _path_or_none, None,
          "file of API keys, one '<key> namespace=NAME|admin' per line (reloaded on SIGHUP)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host with neither --api-keys nor TLS")
    _flag(p, env, "--tls-cert", _path_or_none, None, "TLS certificate (PEM)")
    _flag(p, env, "--tls-key", _path_or_none, None, "TLS private key (PEM)")
    _flag(p, env, "--tls-client-ca", _path_or_none, None,
          "CA (PEM) whose client certificates are required (mutual TLS)")
    _flag(p, env, "--stream-idle-timeout", float, d.stream_idle_timeout_s,
          "seconds a Put may send nothing before it is cancelled (its space freed)")
    _flag(p, env, "--max-streams-per-key", int, d.max_streams_per_key,
          "Put/Get streams one API key may have open at once (RESOURCE_EXHAUSTED beyond)")
    _flag(p, env, "--max-unary-per-key", int, d.max_unary_per_key,
          "with --api-keys: unary calls (Hello, List, Stat, Delete) one key may have running "
          "at once (RESOURCE_EXHAUSTED beyond)")
    _flag(p, env, "--quota-bytes", parse_size, d.quota_bytes,
          "bytes a namespaced key's snapshots may hold (RESOURCE_EXHAUSTED beyond); 0 = off")
    settings.document_env(p, ENV_PREFIX)
    return p


def parse_config(argv: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None) -> SnapshotConfig:
    env = os.environ if env is None else env
    parser = build_parser(env)
    a = settings.parse(parser, argv if argv is not None else sys.argv[1:], env, ENV_PREFIX)
    if a.data_dir is None and not a.store:
        parser.error(f"--data-dir (or {ENV_PREFIX}DATA_DIR) or --store is required")
    try:
        # --store wins over a data dir (the container image sets one by default)
        return SnapshotConfig(data_dir=None if a.store else a.data_dir, host=a.host,
                              port=a.port,
                              max_protocol=a.max_protocol,
                              max_snapshot_bytes=a.max_snapshot_bytes,
                              spare_bytes=a.spare_bytes,
                              metrics_port=a.metrics_port, metrics_host=a.metrics_host,
                              workers=a.workers, grace_s=a.grace,
                              stage_ttl_s=a.stage_ttl, log_level=a.log_level, store=a.store,
                              s3_endpoint=a.s3_endpoint, s3_region=a.s3_region,
                              replica_id=a.replica_id, gc_grace_s=a.gc_grace,
                              api_keys=a.api_keys, insecure=a.insecure, tls_cert=a.tls_cert,
                              tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
                              stream_idle_timeout_s=a.stream_idle_timeout,
                              max_streams_per_key=a.max_streams_per_key,
                              max_unary_per_key=a.max_unary_per_key,
                              quota_bytes=a.quota_bytes)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
