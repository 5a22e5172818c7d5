"""Helpers for tests that need a snapshot service (this package's and others').

    with running_server(tmp_path / "snap") as srv:          # in this process
        client = SnapshotClient(srv.address)

    with ServerProcess(tmp_path / "snap", "--max-protocol", "1") as proc:  # a real process
        client = SnapshotClient(proc.address)
        proc.terminate()                                       # SIGTERM, waits, exit code

Both listen on 127.0.0.1 with a free port.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from snapshot_svc.config import SnapshotConfig
from snapshot_svc.server import SnapshotServer

ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running_server(data_dir: Path | None, **config: Any) -> Iterator[SnapshotServer]:
    """An in-process server on a free port; stopped (grace 0) on exit. `data_dir` None:
    the config names another backend (`store="s3://..."`)."""
    server = SnapshotServer(SnapshotConfig(data_dir=None if data_dir is None else Path(data_dir),
                                           port=0, **config))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0)


class ServerProcess:
    """`python -m snapshot_svc` in a child process, its JSON log lines collected.

    The constructor waits for the "serving" line (port 0 by default: the line says
    which port, so keep --log-level at info). Extra arguments are passed through;
    `env` adds variables."""

    def __init__(self, data_dir: Path | None, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 30.0) -> None:
        argv = [sys.executable, "-m", "snapshot_svc"]
        if data_dir is not None:
            argv += ["--data-dir", str(data_dir)]
        if "--port" not in args:
            argv += ["--port", "0"]
        argv += list(args)
        self.lines: list[dict[str, Any]] = []
        self._new: queue.Queue[dict[str, Any]] = queue.Queue()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, **(env or {})}, text=True)
        assert self.proc.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True)
        self._reader.start()
        try:
            serving = self.wait_for("serving", timeout=start_timeout)
        except BaseException:
            self.__exit__()  # never leave a half-started server behind
            raise
        self.port = int(serving["port"])
        self.address = f"127.0.0.1:{self.port}"

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"msg": "raw", "text": line.rstrip("\n")}
            self.lines.append(rec)
            self._new.put(rec)

    def wait_for(self, event: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first log record with this event (seen before or arriving within timeout)."""
        deadline = time.monotonic() + timeout
        for rec in list(self.lines):
            if rec.get("msg") == event:
                return rec
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {event!r} log line within {timeout}s; "
                                   f"exit code {self.proc.poll()}; log: {self.lines[-20:]}")
            try:
                rec = self._new.get(timeout=min(left, 0.1))
            except queue.Empty:
                if self.proc.poll() is not None and self._new.empty():
                    self._reader.join(1.0)
                    if self._new.empty():
                        raise TimeoutError(f"server exited ({self.proc.returncode}) before "
                                           f"{event!r}; log: {self.lines[-20:]}") from None
                continue
            if rec.get("msg") == event:
                return rec

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Sends a signal and waits for the exit; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._reader.join(5.0)
        return rc

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5.0)
