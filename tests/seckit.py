"""Helpers of the security tests: key files, certificates made with openssl, and raw
calls to every method of a service (whatever its request type)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
from google.protobuf.descriptor import ServiceDescriptor

HEALTH = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def write_keys(path: Path, lines: dict[str, str]) -> Path:
    path.write_text("# test keys\n" + "".join(f"{k} {s}\n" for k, s in lines.items()))
    return path


def methods(service: ServiceDescriptor) -> Iterator[tuple[str, bool, bool]]:
    """(full method path, client streaming, server streaming) of every method."""
    for m in service.methods:
        yield f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming


def raw_call(channel: grpc.Channel, path: str, client_streaming: bool,
             server_streaming: bool, metadata: tuple = (), timeout: float = 10.0,
             request: bytes = b"") -> object:
    """Calls `path` with the serialized `request` (default: an empty message): raises
    the call's RpcError, or returns the raw response(s)."""
    if client_streaming and server_streaming:
        return list(channel.stream_stream(path)(iter([request]), metadata=metadata,
                                                timeout=timeout))
    if client_streaming:
        return channel.stream_unary(path)(iter([request]), metadata=metadata,
                                          timeout=timeout)
    if server_streaming:
        return list(channel.unary_stream(path)(request, metadata=metadata, timeout=timeout))
    return channel.unary_unary(path)(request, metadata=metadata, timeout=timeout)


def code_of(fn: object, *args: object, **kw: object) -> grpc.StatusCode:
    try:
        fn(*args, **kw)  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
            "-subj", f"/CN={name}")
    return cert, key


def make_cert(d: Path, name: str, ca: tuple[Path, Path], expired: bool = False,
              san: str = "DNS:localhost,IP:127.0.0.1") -> tuple[Path, Path]:
    """A certificate for `name` signed by `ca` (valid for localhost and 127.0.0.1);
    `expired`: one whose validity ended a day ago."""
    cert, key, csr = d / f"{name}.crt", d / f"{name}.key", d / f"{name}.csr"
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    dates = ["-days", "-1" if expired else "2"]  # -1: the validity ended a day ago
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
            "-CAcreateserial", "-out", str(cert), "-extfile", str(ext), *dates)
    return cert, key
