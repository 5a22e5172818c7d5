"""The router in front of the inference replicas: writes an HAProxy configuration from
environment variables and runs HAProxy (image deploy/Dockerfile.router).

    router.py config     print the configuration
    router.py run        write it to $WARMSLOT_ROUTER_CONFIG and exec haproxy on it
    router.py health     exit 0 iff at least one replica is UP (the stats page)

Two doors, each routed the same way:
- gRPC (HTTP/2): a request carrying `x-session-id` metadata goes to the replica its value
  hashes to (`balance hdr(x-session-id)`, `hash-type consistent`: a replica taken out moves
  only its own sessions, which the others restore from the shared snapshot namespace); a
  request without one goes to the replica with the fewest requests in progress (leastconn).
- HTTP (the OpenAI API door of the replicas, HTTP/1.1): the same on the `X-Session-Id` header.

With TLS (the compose deployment) HAProxy terminates the client's TLS and opens TLS again to
the replicas, verifying their certificates against the deployment's CA: it must read the
header to route on it, so TLS passthrough (TCP mode) cannot route sessions. API keys
(`authorization`) pass through unchanged; the replicas check them.

Health: every replica's gRPC health (`grpc.health.v1.Health/Check` sent by HAProxy as an
HTTP/2 POST, the answer's SERVING bytes expected), every WARMSLOT_ROUTER_CHECK_INTER; a
replica that stops (SIGTERM: its health says NOT_SERVING before it drains) or dies is taken
out after WARMSLOT_ROUTER_CHECK_FALL failed checks, and a connection refused to a request
also marks it down at once (`observe layer4`). The HTTP door's `/health` check is the
alternative (WARMSLOT_ROUTER_CHECK=http).

Environment:
    WARMSLOT_ROUTER_REPLICAS     host:grpc_port:http_port,... (required); the name of each
                                 server is its host (host:port when the hosts repeat)
    WARMSLOT_ROUTER_BIND         address to listen on (0.0.0.0)
    WARMSLOT_ROUTER_GRPC_PORT    gRPC door (50050)
    WARMSLOT_ROUTER_HTTP_PORT    HTTP door (8000; 0 = none)
    WARMSLOT_ROUTER_STATS_PORT   HAProxy's stats page, /stats and /stats;csv (8404; 0 = none)
    WARMSLOT_ROUTER_TLS_CERT     PEM certificate the doors show (unset: h2c and plain HTTP)
    WARMSLOT_ROUTER_TLS_KEY      its key
    WARMSLOT_ROUTER_TLS_CA       CA the replicas' certificates are checked against
    WARMSLOT_ROUTER_BALANCE      session (default) | roundrobin (every request, session or
                                 not, to the next replica: the baseline of bench/router.py)
    WARMSLOT_ROUTER_CHECK        grpc (default) | http
    WARMSLOT_ROUTER_CHECK_INTER  milliseconds between checks (1000)
    WARMSLOT_ROUTER_CHECK_FALL   failed checks that take a replica out (2)
    WARMSLOT_ROUTER_CHECK_RISE   passed checks that bring it back (1)
    WARMSLOT_ROUTER_RESOLVER     DNS server re-resolving the replicas' names (compose:
                                 127.0.0.11:53; unset: resolved once at start)
    WARMSLOT_ROUTER_TIMEOUT      seconds a request may run (600: a long generation)
    WARMSLOT_ROUTER_CONFIG       where `run` writes the configuration (/tmp/haproxy.cfg)
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SESSION_HEADER = "x-session-id"  # inference_svc.sessions.names.SESSION_HEADER
# grpc.health.v1.Health/Check for the whole server (an empty HealthCheckRequest); SERVING
# is the reply message 00 00000002 08 01 (not compressed, 2 bytes, field 1 = 1)
HEALTH_PATH = "/grpc.health.v1.Health/Check"
HEALTH_SERVING_HEX = "00000000020801"
# any status's reply (UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN), as hex
HEALTH_REPLY_HEX_RE = "0000000002080[0-3]"
# HAProxy reads a certificate and its key from one PEM file: `run` writes it here
PEM_BUNDLE = "/tmp/warmslot-router.pem"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
            + payload)


def _literal(index: int, value: bytes) -> bytes:
    """An HPACK header without indexing, its name from the static table (index < 15)."""
    return bytes((index, len(value))) + value


def health_request(tls: bool) -> bytes:
    """A whole HTTP/2 connection's first bytes asking grpc.health.v1.Health/Check for the
    server's status: the preface, empty SETTINGS, HEADERS and one DATA frame holding an
    empty HealthCheckRequest (5 zero bytes: not compressed, length 0).

    HAProxy 2.6's `http-check send ... body` cannot hold zero bytes (the body ends at the
    first one), so the check is a `tcp-check` sending these bytes and expecting the
    SERVING answer's bytes (HEALTH_SERVING_HEX) in what comes back."""
    block = (b"\x83" + (b"\x87" if tls else b"\x86")  # :method POST, :scheme https/http
             + _literal(0x04, HEALTH_PATH.encode())  # :path
             + _literal(0x01, b"localhost")  # :authority
             + b"\x0f\x10" + bytes((16,)) + b"application/grpc"  # content-type (index 31)
             + b"\x00\x02te\x08trailers")  # te: trailers (a new name)
    return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"")
            + _frame(1, 0x04, 1, block)  # END_HEADERS
            + _frame(0, 0x01, 1, bytes(5)))  # END_STREAM


@dataclass(frozen=True)
class Replica:
    host: str
    grpc_port: int
    http_port: int

    def name(self, unique_hosts: bool) -> str:
        return self.host if unique_hosts else f"{self.host}-{self.grpc_port}"


@dataclass(frozen=True)
class Settings:
    replicas: tuple[Replica, ...]
    bind: str = "0.0.0.0"
    grpc_port: int = 50050
    http_port: int = 8000
    stats_port: int = 8404
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    balance: str = "session"
    check: str = "grpc"
    inter_ms: int = 1000
    fall: int = 2
    rise: int = 1
    resolver: str | None = None
    timeout_s: int = 600

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a port number") from None
    if not 0 <= port < 65536:
        raise ValueError(f"{what} {port} is not a port number")
    return port


def parse_replicas(text: str) -> tuple[Replica, ...]:
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.rsplit(":", 2)
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"replica {item!r}: expected host:grpc_port:http_port")
        out.append(Replica(parts[0], _port(parts[1], "gRPC port"),
                           _port(parts[2], "HTTP port")))
    if not out:
        raise ValueError("WARMSLOT_ROUTER_REPLICAS names no replica "
                         "(host:grpc_port:http_port,...)")
    return tuple(out)


def read_settings(env: Mapping[str, str]) -> Settings:
    def get(name: str) -> str | None:
        value = env.get(f"WARMSLOT_ROUTER_{name}", "").strip()
        return value or None

    def number(name: str, default: int) -> int:
        value = get(name)
        if value is None:
            return default
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"WARMSLOT_ROUTER_{name}={value!r} is not a number") from None
        if n < 1:
            raise ValueError(f"WARMSLOT_ROUTER_{name}={n} must be at least 1")
        return n

    s = Settings(
        replicas=parse_replicas(get("REPLICAS") or ""),
        bind=get("BIND") or "0.0.0.0",
        grpc_port=_port(get("GRPC_PORT") or "50050", "WARMSLOT_ROUTER_GRPC_PORT"),
        http_port=_port(get("HTTP_PORT") or "8000", "WARMSLOT_ROUTER_HTTP_PORT"),
        stats_port=_port(get("STATS_PORT") or "8404", "WARMSLOT_ROUTER_STATS_PORT"),
        tls_cert=get("TLS_CERT"), tls_key=get("TLS_KEY"), tls_ca=get("TLS_CA"),
        balance=get("BALANCE") or "session", check=get("CHECK") or "grpc",
        inter_ms=number("CHECK_INTER", 1000), fall=number("CHECK_FALL", 2),
        rise=number("CHECK_RISE", 1), resolver=get("RESOLVER"),
        timeout_s=number("TIMEOUT", 600))
    if s.balance not in ("session", "roundrobin"):
        raise ValueError(f"WARMSLOT_ROUTER_BALANCE={s.balance!r}: session or roundrobin")
    if s.check not in ("grpc", "http"):
        raise ValueError(f"WARMSLOT_ROUTER_CHECK={s.check!r}: grpc or http")
    if s.tls and (s.tls_key is None or s.tls_ca is None):
        raise ValueError("WARMSLOT_ROUTER_TLS_CERT needs WARMSLOT_ROUTER_TLS_KEY and "
                         "WARMSLOT_ROUTER_TLS_CA (the replicas' CA)")
    if s.check == "http" and any(r.http_port == 0 for r in s.replicas):
        raise ValueError("WARMSLOT_ROUTER_CHECK=http needs every replica's HTTP port")
    return s


def config(s: Settings, pem: str | None = None) -> str:
    """The HAProxy configuration."""
    pem = pem or PEM_BUNDLE
    unique = len({r.host for r in s.replicas}) == len(s.replicas)
    bind_tls = f" ssl crt {pem}" if s.tls else ""
    # to the replicas: TLS, each certificate checked against the deployment's CA (which
    # signs only the deployment's services; not against the host name, which is an
    # address in some deployments), or plain
    srv_tls = f" ssl verify required ca-file {s.tls_ca}" if s.tls else ""
    resolve = (" resolvers dns init-addr last,libc,none resolve-prefer ipv4"
               if s.resolver else "")
    lines = [
        "# written by deploy/router.py from WARMSLOT_ROUTER_* (see its docstring)",
        "global",
        "    log stdout format raw local0 info",
        "    maxconn 4096",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",
        # a replica on the same network answers a connect in well under a millisecond;
        # a killed container's address answers nothing, and the first request after the
        # kill waits this long before it is retried on another replica
        "    timeout connect 1s",
        # a generation streams for as long as it takes; the client side likewise
        f"    timeout client {s.timeout_s}s",
        f"    timeout server {s.timeout_s}s",
        "    timeout check 3s",
        "    timeout http-request 30s",
        # a request refused by a replica that just died is sent to another one
        "    retries 2",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "",
    ]
    if s.resolver:
        lines += ["resolvers dns",
                  f"    nameserver dns {s.resolver}",
                  "    hold valid 5s",
                  "    hold nx 5s",
                  "    hold obsolete 5s",
                  ""]
    if s.stats_port:
        lines += ["frontend stats",
                  f"    bind {s.bind}:{s.stats_port}",
                  "    stats enable",
                  "    stats uri /stats",
                  "    stats refresh 5s",
                  ""]

    def check_grpc(r: Replica) -> str:
        return f" check port {r.grpc_port}"  # TLS or not: the tcp-check connect rule says

    def check_http(r: Replica) -> str:
        # HTTP/1.1 to the HTTP door, whatever the gRPC server line's protocol
        return f" check port {r.http_port} check-proto h1" + (
            " check-ssl check-alpn http/1.1" if s.tls else "")

    def backend(name: str, door: str, header_route: bool) -> list[str]:
        """A backend of all the replicas on one door; header_route: hash on the session."""
        out = [f"backend {name}"]
        if s.balance == "roundrobin":
            out.append("    balance roundrobin")
        elif header_route:
            out += [f"    balance hdr({SESSION_HEADER})", "    hash-type consistent"]
        else:
            out.append("    balance leastconn")
        checked = name in ("grpc_session", "grpc_rr")  # the others track these
        if checked:
            if s.check == "grpc":
                connect = "    tcp-check connect ssl alpn h2" if s.tls else "    tcp-check connect"
                out += ["    option tcp-check", connect,
                        f"    tcp-check send-binary {health_request(s.tls).hex()}",
                        # first the reply message, whatever the status; then SERVING in
                        # it, decided on what has come (min-recv): a mismatch would else
                        # wait for more bytes until the check times out, seconds late
                        f"    tcp-check expect rbinary {HEALTH_REPLY_HEX_RE}",
                        f"    tcp-check expect min-recv 1 binary {HEALTH_SERVING_HEX}"]
            else:
                out += ["    option httpchk",
                        "    http-check send meth GET uri /health",
                        "    http-check expect status 200"]
        proto = " proto h2" if door == "grpc" else ""
        if door == "grpc" and s.tls:
            proto = " alpn h2"
        for r in s.replicas:
            port = r.grpc_port if door == "grpc" else r.http_port
            srv = r.name(unique)
            head = f"    server {srv} {r.host}:{port}{proto}{srv_tls}{resolve}"
            if checked:
                check = check_grpc(r) if s.check == "grpc" else check_http(r)
                out.append(f"{head}{check} inter {s.inter_ms} fall {s.fall} rise {s.rise}"
                           " observe layer4 error-limit 1 on-error mark-down")
            else:
                checked_backend = "grpc_rr" if s.balance == "roundrobin" else "grpc_session"
                out.append(f"{head} track {checked_backend}/{srv}")
        out.append("")
        return out

    grpc_alpn = " alpn h2" if s.tls else " proto h2"
    if s.balance == "roundrobin":
        lines += ["frontend grpc", f"    bind {s.bind}:{s.grpc_port}{bind_tls}{grpc_alpn}",
                  "    default_backend grpc_rr", ""]
        lines += backend("grpc_rr", "grpc", False)
        if s.http_port:
            lines += ["frontend http", f"    bind {s.bind}:{s.http_port}{bind_tls}",
                      "    default_backend http_rr", ""]
            lines += backend("http_rr", "http", False)
        return "\n".join(lines) + "\n"
    lines += ["frontend grpc", f"    bind {s.bind}:{s.grpc_port}{bind_tls}{grpc_alpn}",
              f"    use_backend grpc_session if {{ req.hdr({SESSION_HEADER}) -m found }}",
              "    default_backend grpc_any", ""]
    lines += backend("grpc_session", "grpc", True)
    lines += backend("grpc_any", "grpc", False)
    if s.http_port:
        lines += ["frontend http", f"    bind {s.bind}:{s.http_port}{bind_tls}",
                  f"    use_backend http_session if {{ req.hdr({SESSION_HEADER}) -m found }}",
                  "    default_backend http_any", ""]
        lines += backend("http_session", "http", True)
        lines += backend("http_any", "http", False)
    return "\n".join(lines) + "\n"


def servers_up(stats_addr: str, timeout: float = 3.0) -> dict[str, dict[str, str]]:
    """{backend: {server: status}} from HAProxy's CSV stats page (status: UP, DOWN,
    MAINT, 'no check', ...)."""
    with urllib.request.urlopen(f"http://{stats_addr}/stats;csv", timeout=timeout) as r:
        text = r.read().decode()
    header, *rows = text.splitlines()
    cols = header.lstrip("# ").split(",")
    out: dict[str, dict[str, str]] = {}
    for row in rows:
        rec = dict(zip(cols, row.split(","), strict=False))
        if rec.get("svname") in ("FRONTEND", "BACKEND", None):
            continue
        out.setdefault(rec["pxname"], {})[rec["svname"]] = rec.get("status", "")
    return out


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "run"
    try:
        s = read_settings(os.environ)
    except ValueError as exc:
        print(f"router: {exc}", file=sys.stderr)
        return 2
    if command == "config":
        sys.stdout.write(config(s))
        return 0
    if command == "health":
        if not s.stats_port:
            return 0
        host = "127.0.0.1" if s.bind in ("0.0.0.0", "::") else s.bind
        try:
            states = servers_up(f"{host}:{s.stats_port}")
        except OSError as exc:
            print(f"router: no stats page: {exc}", file=sys.stderr)
            return 1
        up = [n for b in states.values() for n, st in b.items() if st.startswith("UP")]
        print(f"router: {len(set(up))} replica(s) up: {sorted(set(up))}")
        return 0 if up else 1
    if command == "run":
        path = Path(os.environ.get("WARMSLOT_ROUTER_CONFIG", "/tmp/haproxy.cfg"))
        if s.tls:
            assert s.tls_cert is not None and s.tls_key is not None
            pem = Path(PEM_BUNDLE)
            fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(Path(s.tls_cert).read_text() + Path(s.tls_key).read_text())
        path.write_text(config(s))
        haproxy = os.environ.get("WARMSLOT_ROUTER_HAPROXY", "haproxy")
        # -W: master-worker (SIGUSR2 reloads), -db: in the foreground, logs on stdout
        os.execvp(haproxy, [haproxy, "-W", "-db", "-f", str(path)])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
