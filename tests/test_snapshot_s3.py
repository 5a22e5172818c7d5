"""The snapshot service on its two backends (a local directory and the S3 API on a real
SeaweedFS started on 127.0.0.1): one conformance suite of what both must do alike
(round trips, Stat/List/Delete, paired commits, integrity), run on each; then what only
the S3 backend does: replicas sharing a bucket, garbage collection, a crash mid
multipart upload, the store going away, credentials and buckets. What only the local
backend does (spare files, disk full, the data-dir lock...) is in
test_snapshot_service.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from snapshot_svc.client import SnapshotClient
from snapshot_svc.client.contract import MAX_CHUNK_BYTES
from snapshot_svc.client.records import Part, PartMeta
from snapshot_svc.config import SnapshotConfig, parse_config
from snapshot_svc.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from snapshot_svc.pb import snapshot_pb2 as pb
from snapshot_svc.pb import snapshot_pb2_grpc as pb_grpc
from snapshot_svc.s3client import S3Location
from snapshot_svc.s3parts import PART_BYTES
from snapshot_svc.server import SnapshotServer
from snapshot_svc.testing import ROOT, ServerProcess, running_server
from tests.fixtures.snapshot_backends import BACKENDS, BUCKET, raw_s3, s3_config, serve_on
from tests.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS
from tests.snapkit import blob, sha
from tests.test_snapshot_service import commit_draft, put_requests, stage_target, status_of

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def client(snapshot_client: SnapshotClient) -> SnapshotClient:
    """Here `client` is the snapshot service's (the suite's own `client` is the inference
    service's)."""
    return snapshot_client



def keys(fs: SeaweedFS, prefix: str) -> list[str]:
    r = raw_s3(fs).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in r.get("Contents", []))


def uploads(fs: SeaweedFS, prefix: str) -> list[str]:
    r = raw_s3(fs).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    return sorted(u["Key"] for u in r.get("Uploads", []) or [])


@pytest.fixture()
def stub(server: SnapshotServer) -> Iterator[pb_grpc.SnapshotStub]:
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.SnapshotStub(ch)


def stored(server: SnapshotServer) -> dict[str, int]:
    """How many blobs, manifests and staged records (or temp files) the backend holds."""
    s = server.store
    if hasattr(s, "blobs"):
        return {"blobs": len(list(s.blobs.iterdir())),
                "manifests": len(list(s.manifests.iterdir())),
                "staged": len([p for p in s.tmp.iterdir() if not p.name.startswith("spare-")])}
    fs_prefix = f"{server.test_prefix}/"  # type: ignore[attr-defined]
    objs = raw_s3_of(server).list_objects_v2(Bucket=BUCKET, Prefix=fs_prefix).get("Contents", [])
    count = {"blobs": 0, "manifests": 0, "staged": 0}
    for o in objs:
        count[o["Key"][len(fs_prefix):].split("/")[0]] += 1
    assert not raw_s3_of(server).list_multipart_uploads(
        Bucket=BUCKET, Prefix=fs_prefix).get("Uploads"), "an unfinished multipart upload"
    return count


def raw_s3_of(server: SnapshotServer) -> Any:
    return server.store.s3  # type: ignore[attr-defined]


def overwrite_stored(server: SnapshotServer, data: bytes) -> None:
    """Replaces the bytes of the only stored part behind the service's back: a file
    written in the data directory, an object put through the S3 API."""
    s = server.store
    if hasattr(s, "blobs"):
        [path] = list(s.blobs.iterdir())
        path.write_bytes(data)
        return
    prefix = f"{server.test_prefix}/blobs/"  # type: ignore[attr-defined]
    [obj] = raw_s3_of(server).list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    raw_s3_of(server).put_object(Bucket=BUCKET, Key=obj["Key"], Body=data)


def raw_get(stub: pb_grpc.SnapshotStub, name: str,
            client_checks: bool) -> tuple[int, grpc.StatusCode, str]:
    """(data bytes received, status code, details) of a Get through generated stubs."""
    received = 0
    req = pb.GetRequest(name=name, part=pb.PART_TARGET, client_checks_sha256=client_checks)
    try:
        for msg in stub.Get(req, timeout=30):
            received += len(msg.chunk)
    except grpc.RpcError as exc:
        return received, exc.code(), exc.details()
    return received, grpc.StatusCode.OK, ""


def sample(server: SnapshotServer, metric: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(metric, labels) or 0.0


def collect(server: SnapshotServer) -> None:
    """S3: two garbage-collection sweeps with no grace (removes every unreferenced
    object); the local store frees blobs at once."""
    if hasattr(server.store, "collect_garbage"):
        server.store.gc_grace_s = 1e-3  # type: ignore[attr-defined]
        time.sleep(1.1)  # LastModified has a resolution of one second
        server.store.collect_garbage()  # type: ignore[attr-defined]
        server.store.collect_garbage()  # type: ignore[attr-defined]


def stored_blobs(server: SnapshotServer) -> list[str]:
    """The SHA-256 of every stored blob's bytes, sorted, once unreferenced ones are
    collected (`collect`)."""
    s = server.store
    if hasattr(s, "blobs"):  # content-addressed: each file is named by its bytes' digest
        files = {p.name: sha(p.read_bytes()) for p in s.blobs.iterdir()}
        assert all(name == digest for name, digest in files.items()), files
        return sorted(files)
    collect(server)
    prefix = f"{server.test_prefix}/blobs/"  # type: ignore[attr-defined]
    objs = raw_s3_of(server).list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(sha(raw_s3_of(server).get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read())
                  for o in objs)


# --- the service on both backends ----------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, MAX_CHUNK_BYTES - 1, MAX_CHUNK_BYTES,
                                  MAX_CHUNK_BYTES + 1, 3 * MAX_CHUNK_BYTES + 12345, PART_BYTES,
                                  2 * PART_BYTES + 12345])
def test_round_trip_is_byte_identical(client: SnapshotClient, server: SnapshotServer,
                                      size: int) -> None:
    target, draft = blob(1, size), blob(2, size // 3 + 7)
    tm = PartMeta(format_version=1, fingerprint="f" * 64, n_tokens=4000)
    dm = PartMeta(format_version=1, fingerprint="d" * 64, n_tokens=4000)
    res = client.put("session-1", target, draft, tm, dm)
    assert res.protocol == 2 and not res.draft_skipped
    assert res.target.size == size and res.target.sha256 == sha(target)
    assert res.draft is not None and res.draft.size == len(draft)
    assert res.draft.target_sha256 == sha(target)

    got = client.get("session-1")
    assert got.target == target and got.draft == draft
    assert got.info.commit_id == res.commit_id
    assert got.info.target.sha256 == sha(target)
    assert got.info.target.meta == tm and got.info.draft is not None and got.info.draft.meta == dm
    # the stored blobs are the uploaded bytes, verbatim; nothing staged or unfinished
    assert stored_blobs(server) == sorted([sha(target), sha(draft)])
    assert stored(server)["staged"] == 0


def test_stat_list_delete(client: SnapshotClient, server: SnapshotServer) -> None:
    a, ad, b, c = blob(1, 1000), blob(2, 100), blob(3, 2000), blob(4, 3000)
    t0 = int(time.time() * 1000)
    client.put("auto-h-slot0", a, ad, PartMeta(1, "fpa", 42), PartMeta(1, "fpd", 42))
    client.put("auto-h-slot1", b, None, PartMeta(1, "fpa", 7))
    client.put("manual", c)
    st = client.stat("auto-h-slot0")
    assert st.name == "auto-h-slot0" and st.created_unix_ms >= t0
    assert (st.target.size, st.target.sha256, st.target.meta) == (1000, sha(a),
                                                                  PartMeta(1, "fpa", 42))
    assert st.draft is not None
    assert (st.draft.size, st.draft.sha256, st.draft.target_sha256) == (100, sha(ad), sha(a))
    assert st.draft.meta == PartMeta(1, "fpd", 42)
    assert st.total_bytes == 1100

    assert [s.name for s in client.list()] == ["auto-h-slot0", "auto-h-slot1", "manual"]
    assert [s.name for s in client.list("auto-")] == ["auto-h-slot0", "auto-h-slot1"]
    assert [s.name for s in client.list("auto-h-slot1")] == ["auto-h-slot1"]
    assert client.list("zzz") == []
    assert server.store.usage() == (3, 1000 + 100 + 2000 + 3000)

    assert client.delete("auto-h-slot0") == 1100
    with pytest.raises(NotFound):
        client.stat("auto-h-slot0")
    with pytest.raises(NotFound):
        client.get("auto-h-slot0")
    with pytest.raises(NotFound):
        client.delete("auto-h-slot0")
    assert [s.name for s in client.list()] == ["auto-h-slot1", "manual"]
    assert stored_blobs(server) == sorted([sha(b), sha(c)])
    client.delete("auto-h-slot1")
    client.delete("manual")
    assert stored_blobs(server) == []
    assert stored(server) == {"blobs": 0, "manifests": 0, "staged": 0}


def test_staged_target_is_invisible_until_its_draft_commits(
        client: SnapshotClient, stub: pb_grpc.SnapshotStub) -> None:
    old_t, old_d = blob(1, 1000), blob(2, 100)
    client.put("s", old_t, old_d)
    new_t, new_d = blob(3, PART_BYTES + 5), blob(4, 200)  # a multipart upload on S3
    r = stub.Put(iter(put_requests("s", pb.PART_TARGET, new_t, draft_follows=True)), timeout=30)
    assert not r.committed
    got = client.get("s")  # still the old pair
    assert (got.target, got.draft) == (old_t, old_d)
    assert client.stat("s").target.sha256 == sha(old_t)
    r2 = stub.Put(iter(put_requests("s", pb.PART_DRAFT, new_d, target_sha256=sha(new_t))),
                  timeout=30)
    assert r2.committed and r2.has_draft and r2.commit_id == r.commit_id
    got = client.get("s")
    assert (got.target, got.draft) == (new_t, new_d)


def test_last_complete_save_wins(client: SnapshotClient, stub: pb_grpc.SnapshotStub,
                                 server: SnapshotServer) -> None:
    a, b = (blob(1, 3000), blob(2, 300)), (blob(3, 4000), blob(4, 400))
    # first starts, second starts, second completes, first completes: the first's pair
    # survives (A then B, then B then A)
    for (t1, d1), (t2, d2) in ((a, b), (b, a)):
        stage_target(stub, "s", t1, 30)
        stage_target(stub, "s", t2, 30)
        commit_draft(stub, "s", d2, t2, 30)
        commit_draft(stub, "s", d1, t1, 30)
        got = client.get("s")
        assert (got.target, got.draft) == (t1, d1)
    assert stored_blobs(server) == sorted([sha(b[0]), sha(b[1])])


@pytest.mark.parametrize("size", [2 * MAX_CHUNK_BYTES, PART_BYTES + MAX_CHUNK_BYTES])
def test_wrong_digest_is_data_loss_and_stores_nothing(client: SnapshotClient,
                                                      server: SnapshotServer,
                                                      stub: pb_grpc.SnapshotStub,
                                                      size: int) -> None:
    """`size`: PART_BYTES + MAX_CHUNK_BYTES is a multipart upload on S3."""
    old_t, old_d = blob(1, 3000), blob(2, 300)
    client.put("s", old_t, old_d)
    before = stored(server)
    new = blob(3, size)
    # a chunk corrupted in transit (the last one): the header carries the digest of the
    # real bytes
    reqs = put_requests("s", pb.PART_TARGET, new)
    reqs[-1] = pb.PutRequest(chunk=b"\x00" + reqs[-1].chunk[1:])
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(reqs), timeout=30)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "SHA-256 mismatch" in err.value.details()
    # a header whose digest is simply wrong
    assert status_of(lambda: stub.Put(iter(put_requests("s", pb.PART_TARGET, new,
                                                        digest="0" * 64)), timeout=30)) \
        == grpc.StatusCode.DATA_LOSS
    # a wrong draft digest does not break the saved pair either
    reqs = put_requests("s", pb.PART_DRAFT, blob(4, 100), digest=sha(b"other"),
                        target_sha256=sha(old_t))
    assert status_of(lambda: stub.Put(iter(reqs), timeout=30)) == grpc.StatusCode.DATA_LOSS

    assert stored(server) == before
    assert stored_blobs(server) == sorted([sha(old_t), sha(old_d)])
    got = client.get("s")
    assert got.target == old_t and got.draft == old_d
    assert server.metrics.registry.get_sample_value(
        "warmslot_snapshot_digest_failures_total") == 3.0


@pytest.mark.parametrize("why", ["digest mismatch", "declared size over the limit"])
def test_failed_paired_put_removes_its_staged_target_at_once(
        client: SnapshotClient, server: SnapshotServer, stub: pb_grpc.SnapshotStub,
        why: str) -> None:
    """A paired save whose draft fails, whatever the reason, leaves nothing of the new
    target behind (not until the staged target expires: the stage TTL is 300 s here)."""
    old_t, old_d = blob(1, 3000), blob(2, 300)
    client.put("s", old_t, old_d)
    before = stored(server)
    new_t = blob(3, PART_BYTES + MAX_CHUNK_BYTES + 7)  # a multipart upload on S3
    r = stub.Put(iter(put_requests("s", pb.PART_TARGET, new_t, draft_follows=True)),
                 timeout=30)
    assert not r.committed
    assert stored_blobs(server) == sorted([sha(old_t), sha(old_d), sha(new_t)])
    if why == "digest mismatch":
        reqs = put_requests("s", pb.PART_DRAFT, blob(4, 100), digest=sha(b"other"),
                            target_sha256=sha(new_t))
        code = grpc.StatusCode.DATA_LOSS
    else:
        reqs = put_requests("s", pb.PART_DRAFT, blob(4, 100), target_sha256=sha(new_t),
                            size=server.config.max_snapshot_bytes + 1)
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(lambda: stub.Put(iter(reqs), timeout=30)) == code
    assert stored(server) == before  # at once: no garbage collection in between
    assert stored_blobs(server) == sorted([sha(old_t), sha(old_d)])
    got = client.get("s")
    assert (got.target, got.draft) == (old_t, old_d)
    # a draft naming the dropped target is refused: the failed save is over
    reqs = put_requests("s", pb.PART_DRAFT, blob(4, 100), target_sha256=sha(new_t))
    assert status_of(lambda: stub.Put(iter(reqs), timeout=30)) \
        == grpc.StatusCode.FAILED_PRECONDITION


def test_draft_for_another_target_is_refused(client: SnapshotClient, server: SnapshotServer,
                                             stub: pb_grpc.SnapshotStub) -> None:
    t, d = blob(1, 1000), blob(2, 100)
    client.put("s", t, d)
    before = stored(server)
    reqs = put_requests("s", pb.PART_DRAFT, blob(3, 100), target_sha256=sha(b"not it"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(reqs), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stored(server) == before
    assert stored_blobs(server) == sorted([sha(t), sha(d)])
    # a new draft for the current target is accepted (and replaces the old draft)
    d2 = blob(4, 150)
    r = stub.Put(iter(put_requests("s", pb.PART_DRAFT, d2, target_sha256=sha(t))), timeout=30)
    assert r.committed
    got = client.get("s")
    assert (got.target, got.draft) == (t, d2)
    # a reader holding another target gets NOT_FOUND for the draft
    with pytest.raises(NotFound, match="newer save"):
        client.get_part("s", Part.DRAFT, target_sha256=sha(b"old target"))
    data, info = client.get_part("s", Part.DRAFT, target_sha256=sha(t))
    assert data == d2 and info.target_sha256 == sha(t)


DAMAGED_SIZE = 2 * MAX_CHUNK_BYTES + 12345  # three chunks


def damaged_copy(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 1
    return bytes(out)


def server_mismatch(t: bytes, damaged: bytes) -> str:
    return (f"the stored target of 's': SHA-256 mismatch (manifest {sha(t)}, stored bytes "
            f"{sha(damaged)})")


def test_damaged_part_is_data_loss_checked_once(server: SnapshotServer,
                                                stub: pb_grpc.SnapshotStub) -> None:
    t = blob(1, DAMAGED_SIZE)
    damaged = damaged_copy(t)
    with SnapshotClient(server.address, timeout=30) as c:
        c.put("s", t)
        overwrite_stored(server, damaged)
        # protocol 2: the client checks, so the server streams the stored bytes unhashed
        assert c.protocol == 2
        with pytest.raises(DataLoss) as err:
            c.get("s")
        assert err.value.message == "target of 's': SHA-256 mismatch"
    assert raw_get(stub, "s", client_checks=True) == (DAMAGED_SIZE, grpc.StatusCode.OK, "")
    failures = "warmslot_snapshot_digest_failures_total"
    assert sample(server, failures) == 0.0
    assert sample(server, "warmslot_snapshot_gets_total", part="target", code="OK") == 2.0
    # protocol 1, or any client that does not say it checks: the server checks and
    # ends the stream with DATA_LOSS instead of the last chunk
    with SnapshotClient(server.address, timeout=30, max_protocol=1) as old:
        assert old.protocol == 1
        with pytest.raises(DataLoss) as err:
            old.get("s")
        assert err.value.message == server_mismatch(t, damaged)
    assert raw_get(stub, "s", client_checks=False) == (
        2 * MAX_CHUNK_BYTES, grpc.StatusCode.DATA_LOSS, server_mismatch(t, damaged))
    assert sample(server, failures) == 2.0
    assert sample(server, "warmslot_snapshot_gets_total", part="target",
                  code="DATA_LOSS") == 2.0
    # a short part: DATA_LOSS before any data, for every client
    overwrite_stored(server, t[:-1])
    for max_protocol in (1, 2):
        with SnapshotClient(server.address, timeout=30, max_protocol=max_protocol) as c:
            with pytest.raises(DataLoss) as err:
                c.get("s")
            assert err.value.message == (f"the stored target of 's' is {DAMAGED_SIZE - 1} "
                                         f"bytes, expected {DAMAGED_SIZE}")
    overwrite_stored(server, t)  # the right bytes again: served to both
    for max_protocol in (1, 2):
        with SnapshotClient(server.address, timeout=30, max_protocol=max_protocol) as c:
            assert c.get("s").target == t


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_protocol_1_server_checks_for_every_client(backend: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    """A server at --max-protocol 1 predates client checks: it checks every Get."""
    t = blob(2, DAMAGED_SIZE)
    damaged = damaged_copy(t)
    with serve_on(backend, request, tmp_path, max_protocol=1) as srv, \
            grpc.insecure_channel(srv.address) as ch, \
            SnapshotClient(srv.address, timeout=30) as c:
        c.put("s", t)
        overwrite_stored(srv, damaged)
        assert c.protocol == 1
        with pytest.raises(DataLoss) as err:
            c.get("s")
        assert err.value.message == server_mismatch(t, damaged)
        assert raw_get(pb_grpc.SnapshotStub(ch), "s", client_checks=True) == (
            2 * MAX_CHUNK_BYTES, grpc.StatusCode.DATA_LOSS, server_mismatch(t, damaged))
        assert sample(srv, "warmslot_snapshot_digest_failures_total") == 2.0


# --- S3 only -------------------------------------------------------------------------------


def test_replicas_serve_each_others_sessions(s3env: SeaweedFS) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix, "r1")) as a, \
            running_server(None, **s3_config(s3env, prefix, "r2")) as b, \
            SnapshotClient(a.address, timeout=30) as ca, \
            SnapshotClient(b.address, timeout=30) as cb:
        t, d = blob(1, PART_BYTES + 3), blob(2, 500)
        ca.put("s", t, d)
        got = cb.get("s")  # at once, through the other replica
        assert (got.target, got.draft) == (t, d)
        t2 = blob(3, 700)
        cb.put("s", t2, None)
        assert ca.get("s").target == t2 and ca.get("s").draft is None
        assert [s.name for s in ca.list()] == ["s"]
        cb.delete("s")
        with pytest.raises(NotFound):
            ca.stat("s")
        # a target staged through one replica is committed by a draft through the other
        with grpc.insecure_channel(a.address) as cha, grpc.insecure_channel(b.address) as chb:
            pb_grpc.SnapshotStub(cha).Put(iter(put_requests("p", pb.PART_TARGET, t,
                                                            draft_follows=True)), timeout=30)
            r = pb_grpc.SnapshotStub(chb).Put(iter(put_requests(
                "p", pb.PART_DRAFT, d, target_sha256=sha(t))), timeout=30)
        assert r.committed
        got = ca.get("p")
        assert (got.target, got.draft) == (t, d)


def test_concurrent_saves_through_two_replicas(s3env: SeaweedFS) -> None:
    """Four writers on two replicas save pairs of one name; every read is a whole pair."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    errors: list[str] = []
    with running_server(None, **s3_config(s3env, prefix, "r1")) as a, \
            running_server(None, **s3_config(s3env, prefix, "r2")) as b:
        saved: list[tuple[bytes, bytes]] = []

        def writer(w: int) -> None:
            with SnapshotClient((a, b)[w % 2].address, timeout=60) as c:
                for i in range(4):
                    t = blob(1000 * w + i, 50_000 + 997 * i)
                    d = b"draft-of:" + sha(t).encode() + blob(7 * w + i, 3000)
                    c.put("shared", t, d)
                    saved.append((t, d))

        def reader() -> None:
            with SnapshotClient(b.address, timeout=60) as c:
                for _ in range(20):
                    try:
                        got = c.get("shared")
                    except NotFound:
                        continue
                    if got.draft is not None and got.draft[9:73] != sha(got.target).encode():
                        errors.append("a target was served with another save's draft")

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        threads.append(threading.Thread(target=reader))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with SnapshotClient(a.address) as c:
            got = c.get("shared")
        assert not errors
        assert got.draft is not None and (got.target, got.draft) in saved


def test_garbage_collection_keeps_young_and_referenced_objects(s3env: SeaweedFS) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix, gc_grace_s=3600)) as srv, \
            SnapshotClient(srv.address, timeout=30) as c:
        store: Any = srv.store
        c.put("a", blob(1, 1000), blob(2, 100))
        c.put("a", blob(3, 1000), blob(4, 100))  # the first pair is now unreferenced
        c.put("b", blob(5, 1000))
        assert len(keys(s3env, f"{prefix}/blobs/")) == 5
        # within the grace nothing goes: another replica may be about to name it
        assert store.collect_garbage()["blobs_removed"] == 0
        store.gc_grace_s = 1e-3
        time.sleep(1.1)
        # past the grace, the first sweep only marks, the second removes
        assert store.collect_garbage() == {"blobs_removed": 0, "staged_removed": 0,
                                           "uploads_aborted": 0, "blobs_pending": 2}
        assert store.collect_garbage()["blobs_removed"] == 2
        assert len(keys(s3env, f"{prefix}/blobs/")) == 3
        got = c.get("a")
        assert (got.target, got.draft) == (blob(3, 1000), blob(4, 100))
        assert c.get("b").target == blob(5, 1000)


def _stalled_put(address: str, name: str, data: bytes, sent: threading.Event,
                 hold: threading.Event) -> threading.Thread:
    """A Put that sends all but the last chunk of `data`, then waits for `hold`."""

    def run() -> None:
        reqs = put_requests(name, pb.PART_TARGET, data)

        def gen() -> Iterator[pb.PutRequest]:
            yield from reqs[:-1]
            sent.set()
            hold.wait(60)
            yield reqs[-1]

        with grpc.insecure_channel(address) as ch:
            try:
                pb_grpc.SnapshotStub(ch).Put(gen(), timeout=60)
            except grpc.RpcError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_put_streams_its_parts_and_holds_two_at_most(s3env: SeaweedFS) -> None:
    """Parts go to the store while the Put is still receiving: at no point does the
    upload hold more than the part being filled and the one being sent."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix)) as srv:
        store: Any = srv.store
        data = blob(5, 3 * PART_BYTES + 100)
        header = store.check_header("s", Part.TARGET, len(data), sha(data), PartMeta())
        upload = store.begin_put(header)
        try:
            for i in range(0, len(data), MAX_CHUNK_BYTES):
                upload.write(data[i:i + MAX_CHUNK_BYTES])
                assert len(upload._buf) < PART_BYTES  # noqa: SLF001
            upload._wait_part()  # noqa: SLF001 - the third part has been sent
            parts = raw_s3(s3env).list_parts(Bucket=BUCKET, Key=upload.key,
                                             UploadId=upload._upload_id)  # noqa: SLF001
            assert [p["Size"] for p in parts["Parts"]] == [PART_BYTES] * 3
            store.finish_put(upload)
        finally:
            upload.abort()
        with SnapshotClient(srv.address, timeout=30) as c:
            assert c.get("s").target == data


def test_a_client_that_goes_away_leaves_no_upload(s3env: SeaweedFS) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    with running_server(None, **s3_config(s3env, prefix)) as srv:
        sent, hold = threading.Event(), threading.Event()
        data = blob(2, 3 * PART_BYTES)
        reqs = put_requests("s", pb.PART_TARGET, data)

        def gen() -> Iterator[pb.PutRequest]:
            yield from reqs[:-1]
            sent.set()
            hold.wait(60)

        with grpc.insecure_channel(srv.address) as ch:
            call = pb_grpc.SnapshotStub(ch).Put.future(gen(), timeout=60)
            assert sent.wait(60)
            deadline = time.monotonic() + 30
            while not uploads(s3env, f"{prefix}/"):
                assert time.monotonic() < deadline, "no multipart upload started"
                time.sleep(0.1)
            call.cancel()
            hold.set()
        deadline = time.monotonic() + 30
        while uploads(s3env, f"{prefix}/"):
            assert time.monotonic() < deadline, "the upload was not aborted"
            time.sleep(0.1)
        assert keys(s3env, f"{prefix}/") == []


def test_kill_9_mid_multipart_upload(s3env: SeaweedFS, tmp_path: Path) -> None:
    """No torn or half-visible snapshot, and no orphan upload once the replica is back."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    args = ("--store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", s3env.endpoint,
            "--replica-id", "crashy")
    old = blob(1, 5000)
    with ServerProcess(None, *args, env=s3env.env()) as proc:
        with SnapshotClient(proc.address, timeout=30) as c:
            c.put("s", old, b"old-draft")
        sent, hold = threading.Event(), threading.Event()
        t = _stalled_put(proc.address, "s", blob(2, 3 * PART_BYTES), sent, hold)
        assert sent.wait(60)
        deadline = time.monotonic() + 30
        while len(uploads(s3env, f"{prefix}/")) < 1:  # the first parts are uploading
            assert time.monotonic() < deadline, "no multipart upload started"
            time.sleep(0.1)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(10)
        hold.set()
        t.join(30)
    assert len(uploads(s3env, f"{prefix}/")) == 1  # what the crash left behind
    with ServerProcess(None, *args, env=s3env.env()) as proc:
        opened = proc.wait_for("s3_store_opened")
        assert opened["uploads_aborted"] == 1
        assert uploads(s3env, f"{prefix}/") == []
        with SnapshotClient(proc.address, timeout=30) as c:
            got = c.get("s")
            assert (got.target, got.draft) == (old, b"old-draft")
            assert [s.name for s in c.list()] == ["s"]
    assert len(keys(s3env, f"{prefix}/blobs/")) == 2  # the old pair only


def test_store_down_is_unavailable_and_loses_nothing(s3env: SeaweedFS) -> None:
    """The gateway goes away (while a multipart upload is in progress): calls are
    UNAVAILABLE; once it is back, the snapshots are all there, calls succeed, and the
    upload the client abandoned meanwhile is aborted."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    a = blob(1, PART_BYTES + 100)
    with running_server(None, **s3_config(s3env, prefix)) as srv:
        with SnapshotClient(srv.address, timeout=30, retries=0) as c, \
                grpc.insecure_channel(srv.address) as ch:
            c.put("a", a, b"draft-a")
            sent, hold = threading.Event(), threading.Event()
            reqs = put_requests("big", pb.PART_TARGET, blob(3, 3 * PART_BYTES))

            def gen() -> Iterator[pb.PutRequest]:
                yield from reqs[:-1]
                sent.set()
                hold.wait(60)

            call = pb_grpc.SnapshotStub(ch).Put.future(gen(), timeout=120)
            assert sent.wait(60)
            deadline = time.monotonic() + 30
            while not uploads(s3env, f"{prefix}/"):
                assert time.monotonic() < deadline, "no multipart upload started"
                time.sleep(0.1)
            s3env.stop()
            try:
                call.cancel()  # the client goes away while the store is down
                hold.set()
                with pytest.raises(Unavailable, match="unreachable"):
                    c.put("b", blob(2, 1000), b"draft-b")
                with pytest.raises(Unavailable, match="unreachable"):
                    c.get("a")
                with pytest.raises(Unavailable):
                    c.list()
                deadline = time.monotonic() + 30
                while srv.store.leftovers.pending() == 0:  # type: ignore[attr-defined]
                    assert time.monotonic() < deadline, "the failed abort was not kept"
                    time.sleep(0.1)
            finally:
                s3env.start()
        with SnapshotClient(srv.address, timeout=30) as c:  # retries UNAVAILABLE
            got = c.get("a")
            assert (got.target, got.draft) == (a, b"draft-a")
            c.put("b", blob(2, 1000), b"draft-b")
            assert [s.name for s in c.list()] == ["a", "b"]
        deadline = time.monotonic() + 30
        while uploads(s3env, f"{prefix}/"):
            assert time.monotonic() < deadline, "the abandoned upload is still there"
            time.sleep(0.2)
        assert srv.store.leftovers.pending() == 0  # type: ignore[attr-defined]


def _start_failure(fs: SeaweedFS, store: str, env: dict[str, str]) -> dict[str, Any]:
    """Runs the service expecting it to fail at start; its start_failed log record."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    p = subprocess.run([sys.executable, "-m", "snapshot_svc", "--store", store,
                        "--s3-endpoint", fs.endpoint, "--port", "0"], cwd=ROOT,
                       env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr[-2000:]
    records = [json.loads(line) for line in p.stderr.splitlines() if line.startswith("{")]
    [failed] = [r for r in records if r.get("msg") == "start_failed"]
    assert not any(r.get("msg") == "serving" for r in records)
    return failed


def test_wrong_or_missing_credentials_fail_at_start(seaweed: SeaweedFS, tmp_path: Path) -> None:
    store = f"s3://{BUCKET}/creds"
    wrong = _start_failure(seaweed, store, {"AWS_ACCESS_KEY_ID": ACCESS_KEY,
                                            "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert "refused the credentials" in wrong["error"]
    assert f"bucket '{BUCKET}'" in wrong["error"]
    missing = _start_failure(seaweed, store, {"AWS_SHARED_CREDENTIALS_FILE":
                                              str(tmp_path / "none"),
                                              "AWS_CONFIG_FILE": str(tmp_path / "none")})
    assert "no S3 credentials" in missing["error"]
    # a credentials file works as well as the variables
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                     f"aws_secret_access_key = {SECRET_KEY}\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with ServerProcess(None, "--store", store, "--s3-endpoint", seaweed.endpoint,
                       env={**base, "AWS_SHARED_CREDENTIALS_FILE": str(creds)}) as proc:
        with SnapshotClient(proc.address, timeout=30) as c:
            c.put("x", b"hello")
            assert c.get("x").target == b"hello"


def test_missing_bucket_is_created_and_a_bad_one_is_a_clear_error(s3env: SeaweedFS) -> None:
    bucket = f"new-{uuid.uuid4().hex[:10]}"
    s3 = raw_s3(s3env)
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    with running_server(None, store=f"s3://{bucket}/p", s3_endpoint=s3env.endpoint,
                        replica_id="r1") as srv, SnapshotClient(srv.address) as c:
        c.put("x", b"data")
    assert bucket in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    failed = _start_failure(s3env, "s3://no/p", s3env.env())  # too short a bucket name
    assert "'no'" in failed["error"]


def test_store_url_is_checked() -> None:
    assert str(S3Location.parse("s3://b1/a/b/")) == "s3://b1/a/b/"
    assert S3Location.parse("s3://b1").prefix == ""
    for bad in ("s3:///nobucket", "http://b/p", "s3://b/p?x=1"):
        with pytest.raises(InvalidArgument, match="s3://bucket"):
            S3Location.parse(bad)
    with pytest.raises(ValueError, match="not both"):
        SnapshotConfig(data_dir=Path("x"), store="s3://b/p")
    with pytest.raises(ValueError, match="not both"):
        SnapshotConfig()
    # the image sets a data dir; --store (here from its variable) wins over it
    cfg = parse_config([], env={"WARMSLOT_SNAPSHOT_DATA_DIR": "/data",
                                "WARMSLOT_SNAPSHOT_STORE": "s3://b/p",
                                "WARMSLOT_SNAPSHOT_REPLICA_ID": "snap-1"})
    assert (cfg.data_dir, cfg.store, cfg.replica_id) == (None, "s3://b/p", "snap-1")


def test_a_bucket_another_replica_creates_first_is_used(s3env: SeaweedFS,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas starting on a missing bucket: both find it missing, one creates it,
    the other's create is refused (BucketAlreadyExists / ...OwnedByYou) and it must start
    on the bucket all the same, not fail."""
    from snapshot_svc import s3store

    bucket = f"race-{uuid.uuid4().hex[:10]}"
    real = s3store.make_client

    def racing_client(*args: Any, **kw: Any) -> Any:
        client = real(*args, **kw)
        create = client.create_bucket

        def create_after_the_other(**params: Any) -> Any:
            raw_s3(s3env).create_bucket(Bucket=params["Bucket"])  # the other replica
            return create(**params)

        client.create_bucket = create_after_the_other
        return client

    monkeypatch.setattr(s3store, "make_client", racing_client)
    with running_server(None, store=f"s3://{bucket}/p", s3_endpoint=s3env.endpoint,
                        replica_id="r2") as srv, SnapshotClient(srv.address) as c:
        c.put("x", b"data")
        assert c.get("x").target == b"data"
