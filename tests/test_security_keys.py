"""API keys on both services: the key file, UNAUTHENTICATED / PERMISSION_DENIED over
every method of both services' descriptors (health stays open), roles, snapshot
namespaces, reload, and the refusal to serve a non-loopback address open."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.config import Config
from inference_svc.pb import inference_pb2 as ipb
from snapshot_svc.client import SnapshotClient
from snapshot_svc.clientlib.auth import bearer, key_id, parse_keys
from snapshot_svc.config import SnapshotConfig, parse_config
from snapshot_svc.errors import NotFound, ResourceExhausted
from snapshot_svc.pb import snapshot_pb2 as spb
from snapshot_svc.server import SnapshotServer
from tests.fixtures.servicekit import model_pair, running, service_config
from tests.seckit import REFLECTION, code_of, methods, raw_call, write_keys

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
USER, ADMIN = "user-key-0123456789abcdef", "admin-key-0123456789abcdef"
R1, R2, SNAP_ADMIN = "replica-1-key-0123456789", "replica-2-key-0123456789", ADMIN
INFERENCE = ipb.DESCRIPTOR.services_by_name["Inference"]
SNAPSHOT = spb.DESCRIPTOR.services_by_name["Snapshot"]
ADMIN_ONLY = {"ListSlots", "SaveSlot", "RestoreSlot", "EraseSlot"}


def _all_methods(service: object) -> list[tuple[str, bool, bool]]:
    return [*methods(service), (REFLECTION, True, True)]  # type: ignore[arg-type]


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


# --- the key file ----------------------------------------------------------------------


def test_key_file_format() -> None:
    keys = parse_keys(["# comment", "", f"{USER} user", f"  {ADMIN}   admin  "],
                      ("user", "admin"), namespaces=False)
    assert [(p.role, p.namespace) for _, p in keys] == [("user", None), ("admin", None)]
    ns = parse_keys([f"{R1} namespace=replica-1", f"{ADMIN} admin"], ("admin",), True)
    assert [(p.role, p.namespace) for _, p in ns] == [("namespace", "replica-1"),
                                                     ("admin", None)]
    for lines, problem in (
            ([f"{USER}"], "line 1: expected '<key> <scope>', got 1 fields"),
            (["short user"], "line 1: the key is shorter than 16 characters"),
            ([f"{USER} user", f"{USER} admin"], "line 2: the key of an earlier line again"),
            ([f"{USER} root"], "line 1: scope 'root' is not one of admin, user")):
        with pytest.raises(ValueError) as err:
            parse_keys(lines, ("user", "admin"), namespaces=False)
        assert str(err.value) == problem
        assert USER not in str(err.value)  # never the key itself
    with pytest.raises(ValueError, match="namespace 'a/b' must be"):
        parse_keys([f"{R1} namespace=a/b"], ("admin",), True)


def test_non_loopback_without_keys_or_tls_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--insecure"):
        Config(host="0.0.0.0")
    assert Config(host="0.0.0.0", insecure=True).insecure
    assert Config(host="0.0.0.0", api_keys=tmp_path / "k").api_keys is not None
    with pytest.raises(ValueError, match="--insecure"):
        SnapshotConfig(data_dir=tmp_path, host="0.0.0.0")
    with pytest.raises(SystemExit):
        parse_config(["--data-dir", str(tmp_path), "--host", "0.0.0.0"], {})
    env = {"WARMSLOT_SNAPSHOT_INSECURE": "1"}
    assert parse_config(["--data-dir", str(tmp_path), "--host", "0.0.0.0"], env).insecure


# --- snapshot service ------------------------------------------------------------------


@pytest.fixture()
def snap(tmp_path: Path) -> Iterator[SnapshotServer]:
    keys = write_keys(tmp_path / "keys", {R1: "namespace=replica-1",
                                          R2: "namespace=replica-2", SNAP_ADMIN: "admin"})
    with SnapshotServer(SnapshotConfig(data_dir=tmp_path / "data", port=0,
                                       api_keys=keys)) as srv:
        yield srv


def test_snapshot_every_method_needs_a_key(snap: SnapshotServer) -> None:
    with grpc.insecure_channel(snap.address) as ch:
        calls = _all_methods(SNAPSHOT)
        assert len(calls) == 7  # Hello, Put, Get, Stat, List, Delete, reflection
        for path, cs, ss in calls:
            assert code_of(raw_call, ch, path, cs, ss) == UNAUTH, path
            assert code_of(raw_call, ch, path, cs, ss,
                           metadata=bearer("unknown-key-0123456789")) == UNAUTH, path
            assert code_of(raw_call, ch, path, cs, ss,
                           metadata=(("authorization", R1),)) == UNAUTH, path  # no Bearer
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
        # with a key, the same empty requests reach the handlers
        assert code_of(raw_call, ch, f"/{SNAPSHOT.full_name}/List", False, False,
                       metadata=bearer(R1)) == grpc.StatusCode.OK
        assert code_of(raw_call, ch, REFLECTION, True, True,
                       metadata=bearer(R1)) == grpc.StatusCode.OK
    assert snap.metrics.rpcs.labels("List", "UNAUTHENTICATED")._value.get() == 3


def test_snapshot_namespaces(snap: SnapshotServer) -> None:
    with SnapshotClient(snap.address, api_key=R1) as a, \
            SnapshotClient(snap.address, api_key=R2) as b, \
            SnapshotClient(snap.address, api_key=SNAP_ADMIN) as admin:
        a.put("auto-x-slot0", b"A" * 1000)
        assert [s.name for s in a.list()] == ["auto-x-slot0"]
        assert b.list() == []
        for call in (lambda: b.get("auto-x-slot0"), lambda: b.stat("auto-x-slot0"),
                     lambda: b.delete("auto-x-slot0")):
            with pytest.raises(NotFound):
                call()
        b.put("auto-x-slot0", b"B" * 10)  # its own, same name: no clash
        assert bytes(a.get("auto-x-slot0").target) == b"A" * 1000
        assert bytes(b.get("auto-x-slot0").target) == b"B" * 10
        assert a.stat("auto-x-slot0").name == "auto-x-slot0"
        assert [s.name for s in admin.list()] == ["replica-1:auto-x-slot0",
                                                  "replica-2:auto-x-slot0"]
        assert bytes(admin.get("replica-2:auto-x-slot0").target) == b"B" * 10
        assert [s.name for s in a.list("replica-2")] == []  # no way out by prefix
        assert b.delete("auto-x-slot0") == 10
        assert [s.name for s in admin.list()] == ["replica-1:auto-x-slot0"]


def test_snapshot_keys_reload(snap: SnapshotServer, tmp_path: Path) -> None:
    new = "replica-3-key-0123456789"
    write_keys(tmp_path / "keys", {new: "namespace=replica-3", SNAP_ADMIN: "admin"})
    snap.reload_keys()
    with grpc.insecure_channel(snap.address) as ch:
        path = f"/{SNAPSHOT.full_name}/List"
        assert code_of(raw_call, ch, path, False, False, metadata=bearer(R1)) == UNAUTH
        assert code_of(raw_call, ch, path, False, False,
                       metadata=bearer(new)) == grpc.StatusCode.OK
        (tmp_path / "keys").write_text("garbage\n")
        snap.reload_keys()  # a wrong file keeps the keys in force
        assert code_of(raw_call, ch, path, False, False,
                       metadata=bearer(new)) == grpc.StatusCode.OK


# --- inference service -----------------------------------------------------------------


@pytest.fixture(scope="module")
def infer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("keys-infer")
    keys = write_keys(base / "keys", {USER: "user", ADMIN: "admin"})
    cfg = service_config(*model_pair(tmp_path_factory.getbasetemp()),
                         slot_save_path=base / "slots", api_keys=keys)
    with running(cfg) as srv:
        yield srv


def test_inference_every_method_needs_a_key(infer: Server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{infer.port}") as ch:
        calls = _all_methods(INFERENCE)
        assert len(calls) == len(INFERENCE.methods) + 1 >= 9
        for path, cs, ss in calls:
            assert code_of(raw_call, ch, path, cs, ss) == UNAUTH, path
            assert code_of(raw_call, ch, path, cs, ss,
                           metadata=bearer("unknown-key-0123456789")) == UNAUTH, path
            user = code_of(raw_call, ch, path, cs, ss, metadata=bearer(USER))
            admin = code_of(raw_call, ch, path, cs, ss, metadata=bearer(ADMIN))
            if path.rsplit("/", 1)[-1] in ADMIN_ONLY:
                assert user == DENIED, path
            else:
                assert user not in (UNAUTH, DENIED), path
            assert admin not in (UNAUTH, DENIED), path
        assert _health(ch) == health_pb2.HealthCheckResponse.SERVING


def test_inference_roles(infer: Server) -> None:
    addr = f"127.0.0.1:{infer.port}"
    with InferenceClient(addr, api_key=USER) as user, \
            InferenceClient(addr, api_key=ADMIN) as admin:
        tokens = user.tokenize("hello")
        assert user.detokenize(tokens) == admin.detokenize(tokens)
        with pytest.raises(grpc.RpcError) as err:
            user.stub.ListSlots(ipb.ListSlotsRequest(), timeout=10)
        assert err.value.code() == DENIED
        assert "may not call ListSlots" in err.value.details()
        assert len(admin.stub.ListSlots(ipb.ListSlotsRequest(), timeout=10).slots) == 2


def test_sighup_reloads_the_snapshot_services_keys(tmp_path: Path) -> None:
    import signal

    from snapshot_svc.testing import ServerProcess

    keys = write_keys(tmp_path / "keys", {R1: "namespace=replica-1"})
    with ServerProcess(tmp_path / "data", "--api-keys", str(keys)) as srv:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            path = f"/{SNAPSHOT.full_name}/List"
            assert code_of(raw_call, ch, path, False, False,
                           metadata=bearer(R1)) == grpc.StatusCode.OK
            write_keys(keys, {R2: "namespace=replica-2"})
            srv.proc.send_signal(signal.SIGHUP)
            assert srv.wait_for("api_keys_reloaded")["keys"] == 1
            assert code_of(raw_call, ch, path, False, False, metadata=bearer(R1)) == UNAUTH
            assert code_of(raw_call, ch, path, False, False,
                           metadata=bearer(R2)) == grpc.StatusCode.OK
        assert R1 not in "\n".join(map(str, srv.lines))  # keys are never logged


@contextmanager
def _engine_held(tmp_path_factory: pytest.TempPathFactory,
                 **limits: int) -> Iterator[tuple[Server, threading.Event]]:
    """An inference service with USER and ADMIN keys whose engine is busy until the
    event is set (calls that need the engine wait)."""
    keys = write_keys(tmp_path_factory.mktemp("held") / "keys", {USER: "user", ADMIN: "admin"})
    cfg = service_config(*model_pair(tmp_path_factory.getbasetemp()), api_keys=keys, **limits)
    with running(cfg) as srv:
        engine = srv._engine
        assert engine is not None
        held, release = threading.Event(), threading.Event()
        holder = threading.Thread(target=engine.call,
                                  args=(lambda: (held.set(), release.wait(30)),))
        holder.start()
        try:
            assert held.wait(10)
            yield srv, release
        finally:
            release.set()
            holder.join(30)


def test_inference_streams_per_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.test_service_concurrency import sample, wait_for

    with _engine_held(tmp_path_factory, max_streams_per_key=1) as (srv, release):
        addr = f"127.0.0.1:{srv.port}"
        with InferenceClient(addr, api_key=USER) as user, \
                InferenceClient(addr, api_key=ADMIN) as admin:
            first = user.generate_stream(ipb.GenerateRequest(prompt_tokens=[1, 2, 3],
                                                             max_tokens=2))
            second = admin.generate_stream(ipb.GenerateRequest(prompt_tokens=[1, 2, 3],
                                                               max_tokens=2))
            # both wait for the engine (queued), each holding its key's one stream
            wait_for(lambda: sample(srv, "warmslot_queue_depth") == 2, "never queued")
            extra = user.generate_stream(ipb.GenerateRequest(prompt_tokens=[1, 2, 3],
                                                             max_tokens=2))
            with pytest.raises(grpc.RpcError) as err:
                list(extra)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == ("this key has 1 streams open, the limit is 1 "
                                           "(--max-streams-per-key)")
            release.set()
            assert [t for r in first for t in r.tokens]
            assert [t for r in second for t in r.tokens]  # the other key got through


def test_inference_unary_calls_per_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A key's unary calls beyond --max-unary-per-key are refused at once while its
    first ones wait (here for the engine); another key and health checks get through."""
    from tests.test_service_concurrency import wait_for

    with _engine_held(tmp_path_factory, max_unary_per_key=2) as (srv, release):
        addr = f"127.0.0.1:{srv.port}"
        with InferenceClient(addr, api_key=USER) as user, \
                InferenceClient(addr, api_key=ADMIN) as admin, \
                grpc.insecure_channel(addr) as bare:
            waiting = [admin.stub.EraseSlot.future(ipb.EraseSlotRequest(id_slot=i),
                                                   timeout=30) for i in (0, 1)]
            wait_for(lambda: srv.unary.held(key_id(ADMIN)) == 2, "never both running")
            refused = []
            for _ in range(5):
                with pytest.raises(grpc.RpcError) as err:
                    admin.info()
                refused.append((err.value.code(), err.value.details()))
            assert refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "this key has 2 unary calls running, the limit is 2 "
                                "(--max-unary-per-key)")] * 5
            assert user.info().n_slots == 2  # another key
            assert _health(bare) == health_pb2.HealthCheckResponse.SERVING
            assert srv.unary.held(key_id(ADMIN)) == 2
            release.set()
            assert [w.result(30).id_slot for w in waiting] == [0, 1]
            assert srv.unary.held(key_id(ADMIN)) == 0
            assert admin.info().n_slots == 2  # its calls are served again


def test_snapshot_unary_calls_per_key(tmp_path: Path) -> None:
    """Three List calls of one key wait (its store listing is held); its fourth is
    refused at once, another key's List and health checks are served."""
    from tests.test_service_concurrency import wait_for

    keys = write_keys(tmp_path / "keys", {R1: "namespace=replica-1", R2: "namespace=replica-2"})
    cfg = SnapshotConfig(data_dir=tmp_path / "data", port=0, api_keys=keys, workers=8,
                         max_streams_per_key=2, max_unary_per_key=3)
    release = threading.Event()
    with SnapshotServer(cfg) as srv:
        listing = srv.store.list

        def held_list(prefix: str) -> list:
            if prefix.startswith("replica-1:"):
                release.wait(30)
            return listing(prefix)

        srv.store.list = held_list  # type: ignore[method-assign]
        try:
            with SnapshotClient(srv.address, api_key=R1, retries=0) as c1, \
                    SnapshotClient(srv.address, api_key=R2, retries=0) as c2, \
                    grpc.insecure_channel(srv.address) as bare:
                waiting = [threading.Thread(target=c1.list) for _ in range(3)]
                for t in waiting:
                    t.start()
                wait_for(lambda: srv.unary.held(key_id(R1)) == 3, "never all three running")
                with pytest.raises(ResourceExhausted) as err:
                    c1.list()
                assert err.value.message == ("this key has 3 unary calls running, the limit "
                                             "is 3 (--max-unary-per-key)")
                assert c2.list() == []
                assert _health(bare) == health_pb2.HealthCheckResponse.SERVING
                release.set()
                for t in waiting:
                    t.join(30)
                assert srv.unary.held(key_id(R1)) == 0
                assert c1.list() == []
        finally:
            release.set()
    with pytest.raises(ValueError, match="--max-unary-per-key"):
        SnapshotConfig(data_dir=tmp_path / "d", api_keys=keys, workers=8,
                       max_streams_per_key=2, max_unary_per_key=6)
