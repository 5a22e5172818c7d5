"""The HTTP door's life with the server's: it listens before the models load (health 503,
requests 503), a stop lets a running stream finish within the grace or cuts it with an
error event, a port already taken fails the start."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from inference_svc.api.server import Server
from tests.fixtures.servicekit import running
from tests.httpkit import client, error, http_config, post, raw


def test_loading_is_503(tmp_path: Path) -> None:
    srv = Server(http_config(tmp_path))
    srv.start()  # listening, models not loaded
    try:
        status, _, body = raw(srv, "GET", "/health")
        assert (status, json.loads(body)) == error(
            503, "the server is loading its models or stopping", "unavailable")
        assert post(srv, "/v1/completions", {"prompt": "x"}) == error(
            503, "the server is loading its models", "unavailable")
    finally:
        srv.stop(0)


def _stream_during_stop(srv: Server, grace: float, n: int) -> list[str]:
    """The SSE lines a stream of n tokens gets while the server stops with `grace`."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = json.dumps({"prompt": "def f(x):", "max_tokens": n, "temperature": 0,
                           "stream": True})
        conn = socket.create_connection(("127.0.0.1", srv.http_port), timeout=30)
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     f"{len(body)}\r\nContent-Type: application/json\r\n\r\n{body}".encode())
        with conn.makefile("rb") as f:
            for raw_line in f:
                line = raw_line.decode().strip()
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()
                if line == "data: [DONE]" or line == "0":
                    break
        started.set()

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    srv.stop(grace)
    assert time.monotonic() - t0 < grace + 5
    t.join(30)
    assert not t.is_alive()
    return lines


def test_stop_lets_a_stream_finish(tmp_path: Path) -> None:
    srv = Server(http_config(tmp_path))
    srv.start()
    srv.load()
    lines = _stream_during_stop(srv, 10.0, 40)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["timings"]["predicted_n"] == 40


def test_stop_cuts_a_long_stream_with_an_error_event(tmp_path: Path) -> None:
    srv = Server(http_config(tmp_path, threads=1))
    srv.start()
    srv.load()
    lines = _stream_during_stop(srv, 0.05, 480)
    last = json.loads(lines[-1][len("data: "):])
    assert last["error"]["code"] == "unavailable", last
    assert last["error"]["type"] == "unavailable_error"


def test_port_taken_fails_the_start(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError), running(http_config(tmp_path, http_port=port)):
            pass


def test_openai_client_against_a_stopped_server(tmp_path: Path) -> None:
    """After the stop nothing listens: the client gets a connection error, not a hang."""
    import openai

    with running(http_config(tmp_path)) as srv:
        oa = client(srv)
    with pytest.raises(openai.APIConnectionError):
        oa.models.list()
