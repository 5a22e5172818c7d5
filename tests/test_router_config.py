"""deploy/router.py: the HAProxy configuration it writes from WARMSLOT_ROUTER_*, and the
raw HTTP/2 health request its tcp-check sends, against a real grpc.health.v1 server."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _router() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_router", ROOT / "deploy" / "router.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deploy_router"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


router = _router()
REPLICAS = "inference:50051:8080,inference-1:50051:8080,inference-2:50051:8080"


def settings(**env: str) -> object:
    return router.read_settings({"WARMSLOT_ROUTER_REPLICAS": REPLICAS, **env})


def block(cfg: str, head: str) -> str:
    """One section of the configuration (its lines up to the next blank line)."""
    return cfg.split(f"\n{head}\n")[1].split("\n\n")[0]


def test_session_header_is_the_services() -> None:
    from inference_svc.sessions.names import SESSION_HEADER

    assert router.SESSION_HEADER == SESSION_HEADER


def test_sessions_hash_consistently_and_the_rest_go_leastconn() -> None:
    cfg = router.config(settings())
    grpc_front = block(cfg, "frontend grpc")
    assert "use_backend grpc_session if { req.hdr(x-session-id) -m found }" in grpc_front
    assert "default_backend grpc_any" in grpc_front
    session = block(cfg, "backend grpc_session")
    assert "balance hdr(x-session-id)" in session and "hash-type consistent" in session
    assert "balance leastconn" in block(cfg, "backend grpc_any")
    # one health check per replica (grpc_session); every other backend tracks it, so the
    # HTTP door and the session-less requests lose a replica at the same moment
    assert cfg.count(" check port 50051 ") == 3
    for b in ("grpc_any", "http_session", "http_any"):
        lines = block(cfg, f"backend {b}")
        assert [line.split()[1] for line in lines.splitlines() if "server " in line] == [
            "inference", "inference-1", "inference-2"]
        assert lines.count("track grpc_session/") == 3
    assert "server inference-2 inference-2:8080 track" in cfg


def test_tls_terminates_and_reencrypts_verified() -> None:
    cfg = router.config(settings(WARMSLOT_ROUTER_TLS_CERT="/s/service.crt",
                                 WARMSLOT_ROUTER_TLS_KEY="/s/service.key",
                                 WARMSLOT_ROUTER_TLS_CA="/s/ca.crt"), pem="/tmp/r.pem")
    assert "bind 0.0.0.0:50050 ssl crt /tmp/r.pem alpn h2" in cfg
    assert "bind 0.0.0.0:8000 ssl crt /tmp/r.pem\n" in cfg
    assert cfg.count("ssl verify required ca-file /s/ca.crt") == 12  # 4 backends x 3
    assert "tcp-check connect ssl alpn h2" in cfg
    assert router.health_request(True)[:24] == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def test_roundrobin_baseline_ignores_the_session() -> None:
    cfg = router.config(settings(WARMSLOT_ROUTER_BALANCE="roundrobin"))
    assert "x-session-id" not in cfg and "hash-type" not in cfg
    assert cfg.count("balance roundrobin") == 2


@pytest.mark.parametrize(("env", "message"), [
    ({"WARMSLOT_ROUTER_REPLICAS": ""}, "names no replica"),
    ({"WARMSLOT_ROUTER_REPLICAS": "a:1"}, "expected host:grpc_port:http_port"),
    ({"WARMSLOT_ROUTER_REPLICAS": "a:1:x"}, "HTTP port 'x' is not a port number"),
    ({"WARMSLOT_ROUTER_BALANCE": "random"}, "session or roundrobin"),
    ({"WARMSLOT_ROUTER_CHECK_FALL": "0"}, "must be at least 1"),
    ({"WARMSLOT_ROUTER_TLS_CERT": "/c"}, "needs WARMSLOT_ROUTER_TLS_KEY"),
])
def test_bad_settings_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        router.read_settings({"WARMSLOT_ROUTER_REPLICAS": REPLICAS, **env})


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="no haproxy on this host")
@pytest.mark.parametrize("env", [{}, {"WARMSLOT_ROUTER_BALANCE": "roundrobin"},
                                 {"WARMSLOT_ROUTER_CHECK": "http"},
                                 {"WARMSLOT_ROUTER_RESOLVER": "127.0.0.11:53"}])
def test_haproxy_accepts_the_configuration(tmp_path: Path, env: dict[str, str]) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(router.config(router.read_settings({
        "WARMSLOT_ROUTER_REPLICAS": "127.0.0.1:1:2,127.0.0.1:3:4", **env})))
    r = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr


def _ask(port: int, request: bytes) -> bytes:
    """What the server sends back to the raw request within a bounded wait."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        s.settimeout(0.5)
        try:
            while len(data) < 65536:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pass
    return data


def test_the_health_request_reads_the_servers_status() -> None:
    """The bytes the tcp-check sends, to a grpc.health.v1 server: SERVING's bytes come
    back while it serves, and not once it says NOT_SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        serving = bytes.fromhex(router.HEALTH_SERVING_HEX)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert serving in _ask(port, router.health_request(False))
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        reply = _ask(port, router.health_request(False))
        assert serving not in reply and bytes.fromhex("00000000020802") in reply
    finally:
        server.stop(None)
