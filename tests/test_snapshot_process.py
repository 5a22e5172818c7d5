"""The snapshot service as real processes: the CLI and its environment variables,
a client killed mid-upload, restarts, and shutdown on real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.testing import ROOT, ServerProcess
from tests.snapkit import sha

pytestmark = pytest.mark.timeout(120)


def wait_until(cond: object, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not met within {timeout}s"
        time.sleep(0.02)


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# The client that gets killed: it stages a new target (optionally), then starts a
# Put of 4 MiB, sends one 1 MiB chunk, says so, and waits to be killed.
KILLED_CLIENT = textwrap.dedent("""
    import hashlib, sys, time
    import grpc
    from snapshot_svc.pb import snapshot_pb2 as pb, snapshot_pb2_grpc as pb_grpc
    addr, name, mode = sys.argv[1:4]
    stub = pb_grpc.SnapshotStub(grpc.insecure_channel(addr))
    target = b"T" * (3 << 20)
    tsha = hashlib.sha256(target).hexdigest()
    if mode == "draft":
        h = pb.PutHeader(name=name, part=pb.PART_TARGET, size=len(target), sha256=tsha,
                         draft_follows=True)
        chunks = [target[i:i + (1 << 20)] for i in range(0, len(target), 1 << 20)]
        stub.Put(iter([pb.PutRequest(header=h)] + [pb.PutRequest(chunk=c) for c in chunks]),
                 timeout=30)
    data = b"N" * (4 << 20)
    part = pb.PART_DRAFT if mode == "draft" else pb.PART_TARGET
    h = pb.PutHeader(name=name, part=part, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                     target_sha256=tsha if mode == "draft" else "")
    def requests():
        yield pb.PutRequest(header=h)
        yield pb.PutRequest(chunk=data[: 1 << 20])
        print("sent", flush=True)
        time.sleep(120)
    stub.Put(requests(), timeout=300)
""")


@pytest.mark.parametrize("mode", ["target", "draft"])
def test_client_killed_mid_upload_leaves_nothing(tmp_path: Path, mode: str) -> None:
    data = tmp_path / "data"
    with ServerProcess(data, "--stage-ttl", "300") as server, \
            SnapshotClient(server.address) as c:
        c.put("s", b"old-target", b"old-draft")
        before = files(data / "blobs")
        child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.address, "s", mode],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "sent"
            wait_until(lambda: files(data / "tmp") != [], what="upload in progress")
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            child.kill()
            child.wait(10)
        # (a blob nothing references any more becomes a spare file in tmp/: not a leftover)
        wait_until(lambda: [f for f in files(data / "tmp") if not f.startswith("spare-")] == [],
                   what="temporary file removed")
        # grpc reports the lost client as a cancellation or as a stream that ended
        # early (then the size check refuses it): either way nothing is stored
        wait_until(lambda: any(
            r.get("msg") == "rpc_cancelled"
            or (r.get("msg") == "rpc_failed" and "truncated" in r.get("message", ""))
            for r in list(server.lines)), what="upload abandoned")
        got = c.get("s")
        assert (got.target, got.draft) == (b"old-target", b"old-draft")
        assert [s.name for s in c.list()] == ["s"]
        # the staged target of a failed draft never became visible and is gone with it,
        # without waiting for its expiry
        wait_until(lambda: files(data / "blobs") == before, what="staged target removed")
        assert server.terminate() == 0


def test_restart_between_save_and_restore(tmp_path: Path) -> None:
    data = tmp_path / "data"
    target, draft = bytes(range(256)) * 9000, b"\x00draft\xff" * 1000
    env = {"WARMSLOT_SNAPSHOT_DATA_DIR": str(data)}
    with ServerProcess(None, env=env) as first, SnapshotClient(first.address) as c:
        res = c.put("auto-host-slot0", target, draft)
        assert first.terminate() == 0
    assert any(rec.get("msg") == "stopped" for rec in first.lines)
    with ServerProcess(None, env=env) as second, SnapshotClient(second.address) as c:
        got = c.get("auto-host-slot0")
        assert (got.target, got.draft, got.info.commit_id) == (target, draft, res.commit_id)
        assert second.terminate(signal.SIGINT) == 0


def test_sigterm_lets_an_inflight_put_finish(tmp_path: Path) -> None:
    data = tmp_path / "data"
    payload = b"P" * (3 << 20)
    release = threading.Event()
    result: dict[str, object] = {}

    def requests() -> Iterator[pb.PutRequest]:
        h = pb.PutHeader(name="s", part=pb.PART_TARGET, size=len(payload), sha256=sha(payload))
        yield pb.PutRequest(header=h)
        yield pb.PutRequest(chunk=payload[: 1 << 20])
        release.wait(30)
        for i in range(1 << 20, len(payload), 1 << 20):
            yield pb.PutRequest(chunk=payload[i:i + (1 << 20)])

    with ServerProcess(data, "--grace", "20") as server:
        def run() -> None:
            with grpc.insecure_channel(server.address) as ch:
                try:
                    result["response"] = pb_grpc.SnapshotStub(ch).Put(requests(), timeout=60)
                except grpc.RpcError as err:
                    result["code"] = err.code()

        th = threading.Thread(target=run)
        th.start()
        wait_until(lambda: files(data / "tmp") != [], what="upload in progress")
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for("shutting_down")
        time.sleep(0.2)
        assert server.proc.poll() is None  # still draining
        release.set()
        th.join(30)
        assert server.terminate() == 0
    r = result.get("response")
    assert isinstance(r, pb.PutResponse) and r.bytes == len(payload), result
    with ServerProcess(data) as again, SnapshotClient(again.address) as c:
        assert c.get("s").target == payload


def test_cli_flags_and_env(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"WARMSLOT_SNAPSHOT_MAX_PROTOCOL": "1", "WARMSLOT_SNAPSHOT_MAX_SNAPSHOT_BYTES": "1M"}
    with ServerProcess(data, env=env) as server, SnapshotClient(server.address) as c:
        serving = server.wait_for("serving")
        assert (serving["max_protocol"], serving["max_snapshot_bytes"]) == (1, 1 << 20)
        assert serving["host"] == "127.0.0.1"
        assert c.protocol == 1
        # a second server on the same data directory refuses to start
        clash = subprocess.run([sys.executable, "-m", "snapshot_svc", "--data-dir", str(data),
                                "--port", "0"], cwd=ROOT, capture_output=True, text=True,
                               timeout=30)
        assert clash.returncode == 1
        assert '"msg": "start_failed"' in clash.stderr and "in use" in clash.stderr
    usage = subprocess.run([sys.executable, "-m", "snapshot_svc"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30, env={"PATH": ""})
    assert usage.returncode == 2 and "WARMSLOT_SNAPSHOT_DATA_DIR" in usage.stderr
