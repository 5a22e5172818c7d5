"""TLS credentials of both services and of the snapshot client, from PEM files."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc}") from exc


def server_credentials(cert: Path, key: Path,
                       client_ca: Path | None = None) -> grpc.ServerCredentials:
    """A server's certificate chain and key; with `client_ca`, clients must present a
    certificate signed by it (mutual TLS)."""
    chain = _read(cert, "TLS certificate")
    private = _read(key, "TLS key")
    assert chain is not None and private is not None
    ca = _read(client_ca, "client CA")
    return grpc.ssl_server_credentials([(private, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(ca: Path | None, cert: Path | None = None,
                        key: Path | None = None) -> grpc.ChannelCredentials:
    """A client's trust (`ca`; None: the system's roots) and its own certificate for
    mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA certificate"),
        private_key=_read(key, "TLS key"), certificate_chain=_read(cert, "TLS certificate"))


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
METRICS_RISK = "anyone who reaches the metrics endpoint (--metrics-host) could read them"


def check_exposure(host: str, keys: object | None, tls: bool, insecure: bool,
                   flag_prefix: str = "--",
                   risk: str = "anyone who reaches it could read and change every slot"
                   ) -> None:
    """Refuses (ValueError) to serve a non-loopback address with neither keys nor TLS
    unless the operator said --insecure."""
    if host in LOOPBACK or host.startswith("127.") or keys is not None or tls or insecure:
        return
    raise ValueError(f"refusing to listen on {host} without API keys or TLS: {risk}; set "
                     f"{flag_prefix}api-keys "
                     f"and/or {flag_prefix}tls-cert/{flag_prefix}tls-key, or pass "
                     f"{flag_prefix}insecure to serve it open anyway")
