"""Entry point of the Warmslot image: runs one service under a small supervisor.

    entrypoint.py inference [flags...]         python -m inference_svc (flags or WARMSLOT_*)
    entrypoint.py snapshot [flags...]          python -m snapshot_svc (WARMSLOT_SNAPSHOT_*)
    entrypoint.py health inference|snapshot    the health check: exit 0 iff SERVING
    entrypoint.py COMMAND [ARGS...]            anything else is exec'd (bash, python, ...)

A configuration mistake must not turn into a silent crash loop. Before it starts the
service, the supervisor checks what it can (the model files exist, the snapshot service
answers, the data directory is writable). When a check fails, or when the service exits
with an error before it ever reported SERVING, the supervisor logs one line saying why
and answers grpc.health.v1 on the service's port with NOT_SERVING until the container is
stopped: the container stays up and unhealthy instead of restarting. A service that fails
after it has served exits the container, so the restart policy applies.

SIGTERM and SIGINT go to the service (the inference service saves its slots on SIGTERM);
the container exits with the service's status. The health check reads the address the
supervisor wrote to /tmp/warmslot-<service>.addr, so it works whatever the port setting.

Environment of the supervisor itself:
    WARMSLOT_DEPLOY_SNAPSHOT_WAIT  seconds to wait for the snapshot service before saying
                                   it is unreachable (default 60; it keeps retrying after)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the services' shared helpers
    sys.path.insert(0, str(ROOT))
from snapshot_svc.clientlib import jsonlog, settings  # noqa: E402

ADDR_FILE = "/tmp/warmslot-{service}.addr"
RETRY_S = 15.0


def log(level: str, event: str, message: str, **fields: object) -> None:
    """One JSON line on stderr, in the services' log format (jsonlog)."""
    line = jsonlog.record(level, "warmslot.entrypoint", event, message=message, **fields)
    print(json.dumps(line, default=str), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Tls:
    ca: str
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> Any:
        import grpc

        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


@dataclass(frozen=True)
class Target:
    """What the supervisor needs to know of one service's configuration."""

    service: str  # "inference" | "snapshot"
    module: str
    host: str
    port: int
    model: Path | None = None
    draft: Path | None = None
    snapshot_addr: str | None = None
    slot_save_path: Path | None = None
    data_dir: Path | None = None
    store: str | None = None  # snapshot: s3://bucket/prefix instead of data_dir
    # (CA, client certificate, client key) to probe the service's health over TLS, and
    # the snapshot service's (inference); None: plaintext
    tls: Tls | None = None
    snapshot_tls: Tls | None = None

    @property
    def probe_addr(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"


def _none(value: str | None) -> str | None:
    return None if value is None or value.strip().lower() in ("", "none") else value


def read_target(service: str, argv: Sequence[str], env: Mapping[str, str]) -> Target:
    """The few settings the supervisor checks, read like the services read them: a flag
    beats its environment variable, which beats the default."""
    prefix = "WARMSLOT_" if service == "inference" else "WARMSLOT_SNAPSHOT_"
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags = {"--host": "127.0.0.1",
             "--port": "50051" if service == "inference" else "50052"}
    flags.update({"--tls-cert": None, "--tls-key": None})
    if service == "inference":
        flags.update({"--model": str(ROOT / "models" / "target.gguf"),
                      "--draft": str(ROOT / "models" / "draft.gguf"),
                      "--snapshot-addr": None, "--slot-save-path": None,
                      "--snapshot-tls-ca": None, "--snapshot-tls-cert": None,
                      "--snapshot-tls-key": None})
    else:
        flags.update({"--data-dir": None, "--store": None, "--tls-client-ca": None})
    for flag, default in flags.items():
        p.add_argument(flag, default=default)
    a = settings.parse(p, argv, env, prefix, known_only=True)
    try:
        port = int(a.port, 0)
    except ValueError:
        port = -1
    tls = None
    if _none(a.tls_cert):
        # the probe trusts WARMSLOT_DEPLOY_TLS_CA (default: the service's own client CA,
        # else its certificate) and shows the service's certificate as its own (mTLS)
        ca = (env.get("WARMSLOT_DEPLOY_TLS_CA") or _none(getattr(a, "tls_client_ca", None))
              or a.tls_cert)
        tls = Tls(ca, a.tls_cert, _none(a.tls_key))
    if service == "inference":
        snap_tls = (Tls(a.snapshot_tls_ca, _none(a.snapshot_tls_cert),
                        _none(a.snapshot_tls_key)) if _none(a.snapshot_tls_ca) else None)
        return Target(service, "inference_svc", a.host, port, tls=tls, snapshot_tls=snap_tls,
                      model=Path(a.model) if _none(a.model) else None,
                      draft=Path(a.draft) if _none(a.draft) else None,
                      snapshot_addr=_none(a.snapshot_addr),
                      slot_save_path=Path(a.slot_save_path) if _none(a.slot_save_path) else None)
    return Target(service, "snapshot_svc", a.host, port, tls=tls,
                  data_dir=Path(a.data_dir) if _none(a.data_dir) else None,
                  store=_none(a.store))


def _writable_dir(path: Path) -> str | None:
    """None when `path` is (or can be made) a directory this user can write, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by uid {os.getuid()}"
    return None


def static_problem(t: Target) -> str | None:
    """A configuration mistake visible without starting anything, as one sentence."""
    if not 0 < t.port < 65536:
        return f"the {t.service} port is not a port number (0 is not allowed in a container)"
    if t.service == "inference":
        if t.model is None:
            return "no target model configured (--model / WARMSLOT_MODEL)"
        for what, path, var in (("target model", t.model, "WARMSLOT_MODEL"),
                                ("draft model", t.draft, "WARMSLOT_DRAFT")):
            if path is not None and not path.is_file():
                return f"{what} file not found: {path} (set by --{var[9:].lower()} / {var})"
            if path is not None and not os.access(path, os.R_OK):
                return f"{what} file not readable by uid {os.getuid()}: {path}"
        if t.slot_save_path is not None and (why := _writable_dir(t.slot_save_path)):
            return f"slot save path unusable: {why}"
    elif t.store is not None:
        return None  # an S3 bucket: the service checks it (and its credentials) at start
    elif t.data_dir is None:
        return "no data directory configured (--data-dir / WARMSLOT_SNAPSHOT_DATA_DIR)"
    elif why := _writable_dir(t.data_dir):
        return f"snapshot data directory unusable: {why}"
    return None


def health_status(addr: str, timeout: float = 3.0, service: str = "",
                  tls: Tls | None = None) -> str:
    """The grpc.health.v1 status of `addr` ('SERVING', 'NOT_SERVING', ...), or
    'UNREACHABLE: <why>'."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        creds = None if tls is None else tls.credentials()
    except OSError as exc:
        return f"UNREACHABLE: cannot read the TLS files: {exc}"
    try:
        channel = (grpc.insecure_channel(addr) if creds is None
                   else grpc.secure_channel(addr, creds))
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                               wait_for_ready=False)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"UNREACHABLE: {exc.code().name} {exc.details()}"


class Placeholder:
    """A grpc.health.v1 server that says NOT_SERVING on the service's port."""

    def __init__(self, t: Target) -> None:
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._server)
        try:
            self._server.add_insecure_port(f"{t.host}:{t.port}")
        except RuntimeError as exc:  # port taken or bad host: still no crash loop
            log("error", "placeholder_bind_failed", f"cannot bind {t.host}:{t.port}: {exc}")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait()


class Supervisor:
    def __init__(self, t: Target, argv: Sequence[str]) -> None:
        self.t = t
        self.argv = list(argv)
        self.stop = threading.Event()
        self.signum: int | None = None
        self.child: subprocess.Popen[bytes] | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        self.signum = signum
        self.stop.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def hold(self, placeholder: Placeholder | None) -> int:
        """NOT_SERVING until the container is stopped."""
        placeholder = placeholder or Placeholder(self.t)
        self.stop.wait()
        placeholder.stop()
        return 0

    def wait_for_snapshot(self, placeholder: Placeholder) -> bool:
        """True once the snapshot service answers SERVING; False if stopped first."""
        addr = self.t.snapshot_addr
        assert addr is not None
        budget = float(os.environ.get("WARMSLOT_DEPLOY_SNAPSHOT_WAIT", "60"))
        start = time.monotonic()
        said = False
        delay = 0.5
        while not self.stop.is_set():
            # a list of replicas (a,b): one that serves is enough, the service fails over
            statuses = [health_status(a.strip(), timeout=2.0, tls=self.t.snapshot_tls)
                        for a in addr.split(",")]
            status = "SERVING" if "SERVING" in statuses else "; ".join(statuses)
            if status == "SERVING":
                if said:
                    log("info", "snapshot_reachable",
                        f"snapshot service at {addr} answers now; starting the inference service")
                return True
            if not said and time.monotonic() - start >= budget:
                log("error", "not_starting",
                    f"snapshot service at {addr} is unreachable ({status}) after {budget:g} s: "
                    f"sessions could be neither restored nor saved, so the inference service "
                    f"is not started; health says NOT_SERVING; retrying every {RETRY_S:g} s "
                    f"(check --snapshot-addr / WARMSLOT_SNAPSHOT_ADDR)",
                    service="inference", snapshot_addr=addr, status=status)
                said = True
            self.stop.wait(RETRY_S if said else delay)
            delay = min(delay * 2, 5.0)
        return False

    def run(self) -> int:
        t = self.t
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        Path(ADDR_FILE.format(service=t.service)).write_text(t.probe_addr + "\n")
        problem = static_problem(t)
        if problem:
            log("error", "not_starting",
                f"{problem}; the {t.service} service is not started and health says "
                f"NOT_SERVING until the container is stopped", service=t.service)
            return self.hold(None)
        if t.snapshot_addr:
            placeholder = Placeholder(t)
            ok = self.wait_for_snapshot(placeholder)
            placeholder.stop()
            if not ok:
                return 0
        started = time.monotonic()
        self.child = subprocess.Popen([sys.executable, "-m", t.module, *self.argv])
        if self.stop.is_set():  # a signal that came while the child was starting
            self.child.send_signal(self.signum or signal.SIGTERM)
        served = False
        while True:
            try:
                code = self.child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if not served and not self.stop.is_set():
                served = health_status(t.probe_addr, timeout=1.0, tls=t.tls) == "SERVING"
                if served:
                    log("info", "serving", f"{t.service} service is SERVING",
                        service=t.service, seconds=round(time.monotonic() - started, 2))
        if code < 0:  # killed by a signal: report it the way a shell does
            code = 128 - code
        if self.stop.is_set():
            return code
        if not served:
            log("error", "not_starting",
                f"the {t.service} service exited with status {code} before it was serving "
                f"(the lines above say why); health says NOT_SERVING until the container "
                f"is stopped", service=t.service, status=code)
            return self.hold(None)
        log("error", "exited", f"the {t.service} service exited with status {code} after "
            f"serving; the container exits so that its restart policy applies",
            service=t.service, status=code)
        return code or 1


def health_main(args: Sequence[str]) -> int:
    service = args[0] if args else "inference"
    t = read_target(service, [], os.environ)
    try:
        addr = Path(ADDR_FILE.format(service=service)).read_text().strip()
    except OSError:
        addr = t.probe_addr
    status = health_status(addr, tls=t.tls)
    print(f"{service} {addr}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str]) -> int:
    if not argv:
        argv = ["inference"]
    command, rest = argv[0], list(argv[1:])
    if command == "health":
        return health_main(rest)
    if command in ("inference", "snapshot"):
        return Supervisor(read_target(command, rest, os.environ), rest).run()
    os.execvp(command, [command, *rest])
    return 127  # unreachable


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
