"""Command-line client of the snapshot service.

    python -m snapshot_svc.ctl [--addr HOST:PORT] hello
    python -m snapshot_svc.ctl put NAME --dir DIR            # DIR/NAME (+ DIR/NAME.drft)
    python -m snapshot_svc.ctl put NAME --target FILE [--draft FILE] [--n-tokens N ...]
    python -m snapshot_svc.ctl get NAME --dir DIR            # writes DIR/NAME (+ NAME.drft)
    python -m snapshot_svc.ctl get NAME --target FILE [--draft FILE]
    python -m snapshot_svc.ctl stat NAME
    python -m snapshot_svc.ctl ls [PREFIX]
    python -m snapshot_svc.ctl rm NAME

`--dir` uses the layout of the inference service's local store (`--slot-save-path`):
`<name>` is the target file, `<name>.drft` its draft sidecar, so snapshots move
between the two stores byte for byte. Output is JSON; errors exit 1 with the
status code.

The connection settings read the variables the inference service's snapshot client
reads: `--addr` $WARMSLOT_SNAPSHOT_ADDR (default 127.0.0.1:50052; a comma-separated
list of replicas sharing one store is tried in order while a replica is unavailable),
`--api-key-file` $WARMSLOT_SNAPSHOT_KEY_FILE (the file's first word is sent as
`authorization: Bearer <key>`), `--tls-ca` / `--tls-cert` / `--tls-key`
$WARMSLOT_SNAPSHOT_CLIENT_TLS_CA / _CERT / _KEY (TLS, and a client certificate for a
service that requires one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.names import validate_name
from snapshot_svc.client.records import PartInfo, PartMeta, SnapshotInfo
from snapshot_svc.clientlib import auth, tls
from snapshot_svc.config import DEFAULT_PORT
from snapshot_svc.errors import SnapshotError

DRAFT_SUFFIX = ".drft"


def _part_json(p: PartInfo | None) -> dict[str, Any] | None:
    if p is None:
        return None
    d = asdict(p)
    d["part"] = p.part.label
    return d


def _snapshot_json(s: SnapshotInfo) -> dict[str, Any]:
    return {"name": s.name, "commit_id": s.commit_id, "created_unix_ms": s.created_unix_ms,
            "generation": s.generation, "target": _part_json(s.target),
            "draft": _part_json(s.draft)}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _paths(a: argparse.Namespace) -> tuple[Path, Path | None]:
    if a.dir is not None:
        return a.dir / a.name, a.dir / (a.name + DRAFT_SUFFIX)
    if a.target is None:
        raise SystemExit("give --dir DIR or --target FILE")
    return a.target, a.draft


def run(a: argparse.Namespace, client: SnapshotClient) -> Any:
    if a.cmd == "hello":
        return {**asdict(client.server_info()), "address": client.addr}
    if a.cmd == "ls":
        return [_snapshot_json(s) for s in client.list(a.prefix)]
    validate_name(a.name)
    if a.cmd == "stat":
        return _snapshot_json(client.stat(a.name))
    if a.cmd == "rm":
        return {"name": a.name, "bytes_freed": client.delete(a.name)}
    target_path, draft_path = _paths(a)
    if a.cmd == "put":
        draft = None
        if draft_path is not None and (a.draft is not None or draft_path.exists()):
            draft = draft_path.read_bytes()
        res = client.put(a.name, target_path.read_bytes(), draft,
                         PartMeta(a.format_version, a.fingerprint, a.n_tokens),
                         PartMeta(a.format_version, a.draft_fingerprint, a.n_tokens),
                         expected_generation=a.expected_generation)
        return {"name": res.name, "commit_id": res.commit_id, "protocol": res.protocol,
                "generation": res.generation,
                "target": _part_json(res.target), "draft": _part_json(res.draft),
                "draft_skipped": res.draft_skipped, "note": res.note}
    got = client.get(a.name, with_draft=draft_path is not None)
    _write_atomic(target_path, got.target)
    if draft_path is not None:
        if got.draft is not None:
            _write_atomic(draft_path, got.draft)
        elif a.dir is not None and draft_path.exists():
            draft_path.unlink()  # a stale sidecar must not pair with the new target
    out = _snapshot_json(got.info)
    out.update(target_file=str(target_path),
               draft_file=str(draft_path) if got.draft is not None else None,
               draft_note=got.draft_note)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m snapshot_svc.ctl",
                                description="Talk to a Warmslot snapshot service.")
    env = os.environ.get
    p.add_argument("--addr", default=env("WARMSLOT_SNAPSHOT_ADDR", f"127.0.0.1:{DEFAULT_PORT}"),
                   help="HOST:PORT, or a comma-separated list tried in order "
                        "[env WARMSLOT_SNAPSHOT_ADDR]")
    p.add_argument("--api-key-file", type=Path, default=env("WARMSLOT_SNAPSHOT_KEY_FILE"),
                   help="file holding the API key to send [env WARMSLOT_SNAPSHOT_KEY_FILE]")
    for name, what in (("ca", "CA (PEM) of the service's certificate: connect with TLS"),
                       ("cert", "client certificate (PEM), for a service that requires one"),
                       ("key", "key (PEM) of --tls-cert")):
        var = f"WARMSLOT_SNAPSHOT_CLIENT_TLS_{name.upper()}"
        p.add_argument(f"--tls-{name}", type=Path, default=env(var), help=f"{what} [env {var}]")
    p.add_argument("--timeout", type=float, default=30.0, help="deadline per call, seconds")
    p.add_argument("--max-protocol", type=int, default=2, choices=(1, 2))
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("hello", help="negotiate and show the server's protocol and limits")
    ls = sub.add_parser("ls", help="list snapshots")
    ls.add_argument("prefix", nargs="?", default="")
    for cmd in ("stat", "rm"):
        sub.add_parser(cmd).add_argument("name")
    for cmd in ("put", "get"):
        c = sub.add_parser(cmd)
        c.add_argument("name")
        c.add_argument("--dir", type=Path, help="local store directory (<name>, <name>.drft)")
        c.add_argument("--target", type=Path, help="target file")
        c.add_argument("--draft", type=Path, help="draft sidecar file")
        if cmd == "put":
            c.add_argument("--format-version", type=int, default=0)
            c.add_argument("--fingerprint", default="", help="target model fingerprint")
            c.add_argument("--draft-fingerprint", default="", help="draft model fingerprint")
            c.add_argument("--n-tokens", type=int, default=0)
            c.add_argument("--expected-generation", type=int, default=None,
                           help="store only if the snapshot is at this generation now (0: "
                                "only if there is none); ABORTED otherwise")
    return p


def security(a: argparse.Namespace) -> dict[str, Any]:
    """The client's TLS credentials and API key from the flags (ValueError: unreadable
    files, a certificate without its key)."""
    if (a.tls_cert is not None or a.tls_key is not None) and a.tls_ca is None:
        raise ValueError("--tls-cert and --tls-key need --tls-ca")
    creds = (tls.channel_credentials(a.tls_ca, a.tls_cert, a.tls_key)
             if a.tls_ca is not None else None)
    key = auth.read_key_file(a.api_key_file) if a.api_key_file is not None else None
    return {"credentials": creds, "api_key": key}


def run_on_first(a: argparse.Namespace, sec: dict[str, Any]) -> Any:
    """run() on the first address of --addr that is available."""
    addrs = [x.strip() for x in a.addr.split(",") if x.strip()]
    for i, addr in enumerate(addrs):
        try:
            with SnapshotClient(addr, timeout=a.timeout, max_protocol=a.max_protocol,
                                **sec) as client:
                return run(a, client)
        except SnapshotError as exc:
            if exc.code is not grpc.StatusCode.UNAVAILABLE or i == len(addrs) - 1:
                raise
    raise SystemExit("--addr names no address")


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        out = run_on_first(a, security(a))
    except ValueError as exc:
        print(json.dumps({"error": "INVALID_ARGUMENT", "message": str(exc)}), file=sys.stderr)
        return 1
    except SnapshotError as exc:
        print(json.dumps({"error": exc.code.name, "message": exc.message}), file=sys.stderr)
        return 1
    except OSError as exc:
        print(json.dumps({"error": "OS_ERROR", "message": str(exc)}), file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
