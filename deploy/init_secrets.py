"""First-start step of the compose deployment: makes the TLS certificates and API keys
the services use, once, in a volume (`secrets`, mounted at /secrets).

    python3 deploy/init_secrets.py DIR REPLICA [REPLICA...]

Files in DIR (kept when they all exist already; the step is then a no-op):
    ca.crt, ca.key             the deployment's CA
    service.crt, service.key   every service's certificate (server and client use), valid
                               for the compose service names, the replicas, localhost and
                               127.0.0.1, signed by the CA
    snapshot-keys              snapshot service: one namespace key per replica, one admin
    replica-<name>.key         each replica's snapshot key (its namespace is its name)
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


def make(d: Path, replicas: list[str]) -> bool:
    """Makes the files; False when they exist already."""
    names = ["ca.crt", "ca.key", "service.crt", "service.key", "snapshot-keys",
             "inference-keys", "admin.key", "user.key",
             *(f"replica-{r}.key" for r in replicas)]
    if all((d / n).exists() for n in names):
        return False
    d.mkdir(parents=True, exist_ok=True)
    os.umask(0o077)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
             "-days", DAYS, "-subj", "/CN=warmslot deployment CA")
    sans = ",".join([*(f"DNS:{n}" for n in ("snapshot", "inference", "localhost", *replicas)),
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
    replica_keys = {r: _key() for r in replicas}
    admin, user = _key(), _key()
    for r, k in replica_keys.items():
        _write(d / f"replica-{r}.key", k + "\n")
    _write(d / "snapshot-keys", "".join(f"{k} namespace={r}\n" for r, k in replica_keys.items())
           + f"{admin} admin\n")
    _write(d / "inference-keys", f"{admin} admin\n{user} user\n")
    _write(d / "admin.key", admin + "\n")
    _write(d / "user.key", user + "\n")
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    made = make(Path(argv[0]), argv[1:])
    print(("made" if made else "kept") + f" the TLS certificates and API keys in {argv[0]}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
