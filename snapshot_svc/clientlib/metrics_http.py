"""The Prometheus metrics endpoint of both services, as safe as their gRPC port: with
the service's TLS certificate it speaks HTTPS (and with its client CA requires a
client certificate), with its API keys it requires `Authorization: Bearer <admin key>`
(401 without a known key, 403 for a key that is not admin). Without either it must
listen on loopback unless the operator said --insecure (`check_exposure`)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from snapshot_svc.clientlib import auth
from snapshot_svc.clientlib.errors import Unauthenticated

HANDSHAKE_S = 10.0  # longest a connection may take for its TLS handshake and request


class _Quiet(WSGIRequestHandler):
    timeout = HANDSHAKE_S  # bounds the handshake (done on the first read) and the request

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed handshake or a dropped connection: the client's problem, not logged


def _guarded(app: Callable[..., Iterable[bytes]], keys: auth.KeyRing
             ) -> Callable[..., Iterable[bytes]]:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION")
        try:
            principal = keys.authenticate([("authorization", header)] if header else [])
        except Unauthenticated as exc:
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", "Bearer")])
            return [exc.message.encode() + b"\n"]
        if not principal.is_admin:
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"the metrics need an admin API key\n"]
        return app(environ, start_response)

    return guarded


def serve(registry: CollectorRegistry, host: str, port: int, *,
          cert: Path | None = None, key: Path | None = None, client_ca: Path | None = None,
          keys: auth.KeyRing | None = None) -> tuple[int, Callable[[], None]]:
    """Starts the endpoint on a thread of its own; returns its port and a function that
    stops it."""
    app = make_wsgi_app(registry)
    if keys is not None:
        app = _guarded(app, keys)
    httpd: WSGIServer = make_server(host, port, app, _Server, handler_class=_Quiet)
    if cert is not None and key is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(str(client_ca))
        # the handshake runs on the connection's own thread (bounded by _Quiet.timeout),
        # not in the accepting loop, so a silent client holds up no one
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True,
                                       do_handshake_on_connect=False)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return httpd.server_port, stop
