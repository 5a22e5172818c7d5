"""First-start step of the compose deployment: makes the TLS certificates and API keys
the services use, once, in a volume (`secrets`, mounted at /secrets).

    python3 deploy/init_secrets.py DIR [--shared NAMESPACE]... REPLICA [REPLICA...]

Files in DIR (kept when they exist already: a later run only adds the snapshot keys of
replicas or shared namespaces it does not find, appending them to snapshot-keys; the snapshot
service reads them when it starts, or on SIGHUP):
    ca.crt, ca.key             the deployment's CA
    service.crt, service.key   every service's certificate (server and client use), valid
                               for the compose service names, the replicas, localhost and
                               127.0.0.1, signed by the CA
    snapshot-keys              snapshot service: one namespace key per replica and per shared
                               namespace, one admin
    replica-<name>.key         each replica's snapshot key (its namespace is its name): the
                               replicas that use it cannot reach each other's snapshots
    namespace-<ns>.key         a snapshot key of namespace <ns> that several replicas use:
                               they share sessions (the compose `replicas` profile)
    inference-keys             inference service: one admin and one user key
    admin.key, user.key        those two keys, for operators and clients
Certificates are made with the openssl command (in the image: ca-certificates needs it).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

DAYS = "3650"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=120)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _key() -> str:
    return secrets.token_urlsafe(32)


def _snapshot_keys(replicas: list[str], shared: list[str]) -> dict[str, str]:
    """{file name: namespace} of the snapshot keys."""
    return {**{f"replica-{r}.key": r for r in replicas},
            **{f"namespace-{ns}.key": ns for ns in shared}}


def _add_keys(d: Path, wanted: dict[str, str]) -> bool:
    """Adds the snapshot keys of `wanted` that DIR lacks; False when it has them all."""
    missing = {f: ns for f, ns in wanted.items() if not (d / f).exists()}
    if not missing:
        return False
    lines = (d / "snapshot-keys").read_text()
    for f, ns in missing.items():
        k = _key()
        _write(d / f, k + "\n")
        lines += f"{k} namespace={ns}\n"
    _write(d / "snapshot-keys", lines)
    return True


def make(d: Path, replicas: list[str], shared: list[str] | None = None) -> bool:
    """Makes the files (or adds the missing snapshot keys); False when nothing was
    missing."""
    base = ["ca.crt", "ca.key", "service.crt", "service.key", "snapshot-keys",
            "inference-keys", "admin.key", "user.key"]
    wanted = _snapshot_keys(replicas, shared or [])
    if all((d / n).exists() for n in base):
        return _add_keys(d, wanted)
    d.mkdir(parents=True, exist_ok=True)
    os.umask(0o077)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
             "-days", DAYS, "-subj", "/CN=warmslot deployment CA")
    sans = ",".join([*(f"DNS:{n}" for n in ("snapshot", "inference", "router", "localhost",
                                            *replicas)),
                     "IP:127.0.0.1"])
    ext = d / "service.ext"
    ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", *ec, "-keyout", str(d / "service.key"), "-out", str(d / "service.csr"),
             "-subj", "/CN=warmslot")
    _openssl("x509", "-req", "-in", str(d / "service.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", str(d / "service.crt"),
             "-days", DAYS, "-extfile", str(ext))
    for leftover in ("service.csr", "service.ext", "ca.srl"):
        (d / leftover).unlink(missing_ok=True)
    keys = {f: _key() for f in wanted}
    admin, user = _key(), _key()
    for f, k in keys.items():
        _write(d / f, k + "\n")
    _write(d / "snapshot-keys", "".join(f"{k} namespace={wanted[f]}\n" for f, k in keys.items())
           + f"{admin} admin\n")
    _write(d / "inference-keys", f"{admin} admin\n{user} user\n")
    _write(d / "admin.key", admin + "\n")
    _write(d / "user.key", user + "\n")
    return True


def main(argv: list[str]) -> int:
    shared: list[str] = []
    replicas: list[str] = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--shared":
            shared.append(next(rest, ""))
        else:
            replicas.append(arg)
    if not argv or not replicas or "" in shared:
        print(__doc__, file=sys.stderr)
        return 2
    made = make(Path(argv[0]), replicas, shared)
    print(("made or added" if made else "kept")
          + f" the TLS certificates and API keys in {argv[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
