"""TLS and mutual TLS on both services, with certificates made here by openssl: real
handshakes, and each failure (wrong CA, expired certificate, no client certificate,
plaintext client to a TLS server) a clear UNAVAILABLE on the client."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from inference_svc.client import InferenceClient
from inference_svc.pb import inference_pb2 as ipb
from snapshot_svc.client import SnapshotClient
from snapshot_svc.clientlib.tls import channel_credentials
from snapshot_svc.config import SnapshotConfig
from snapshot_svc.errors import Unavailable
from snapshot_svc.server import SnapshotServer
from tests.fixtures.servicekit import model_pair, running, service_config
from tests.seckit import make_ca, make_cert, write_keys

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Pki:
    ca: tuple[Path, Path]
    other_ca: tuple[Path, Path]
    server: tuple[Path, Path]
    expired: tuple[Path, Path]
    client: tuple[Path, Path]
    stranger: tuple[Path, Path]  # a client certificate of the other CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(d, "ca"), make_ca(d, "other-ca")
    return Pki(ca, other, make_cert(d, "server", ca), make_cert(d, "old", ca, expired=True),
               make_cert(d, "client", ca), make_cert(d, "stranger", other))


def _snap(tmp_path: Path, cert: tuple[Path, Path], client_ca: Path | None = None
          ) -> SnapshotServer:
    return SnapshotServer(SnapshotConfig(data_dir=tmp_path / "data", port=0,
                                         tls_cert=cert[0], tls_key=cert[1],
                                         tls_client_ca=client_ca))


def _client(srv: SnapshotServer, creds: grpc.ChannelCredentials | None) -> SnapshotClient:
    # "localhost": the name in the server's certificate
    return SnapshotClient(f"localhost:{srv.port}", credentials=creds, retries=0, timeout=5)


def _refused(srv: SnapshotServer, creds: grpc.ChannelCredentials | None) -> str:
    with _client(srv, creds) as c, pytest.raises(Unavailable) as err:
        c.list()
    return err.value.message


def test_snapshot_tls(pki: Pki, tmp_path: Path) -> None:
    with _snap(tmp_path, pki.server) as srv:
        with _client(srv, channel_credentials(pki.ca[0])) as c:
            c.put("a", b"x" * 3_000_000)
            assert bytes(c.get("a").target) == b"x" * 3_000_000
        # a client that trusts another CA does not accept the server
        assert "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate" in \
            _refused(srv, channel_credentials(pki.other_ca[0]))
        # a plaintext client cannot speak to a TLS server: the server hangs up
        assert "Socket closed" in _refused(srv, None)


def test_snapshot_expired_certificate(pki: Pki, tmp_path: Path) -> None:
    with _snap(tmp_path, pki.expired) as srv:
        assert "CERTIFICATE_VERIFY_FAILED: certificate has expired" in \
            _refused(srv, channel_credentials(pki.ca[0]))


def test_snapshot_mutual_tls(pki: Pki, tmp_path: Path) -> None:
    with _snap(tmp_path, pki.server, client_ca=pki.ca[0]) as srv:
        _refused(srv, channel_credentials(pki.ca[0]))  # no client certificate
        _refused(srv, channel_credentials(pki.ca[0], *pki.stranger))  # the other CA's
        with _client(srv, channel_credentials(pki.ca[0], *pki.client)) as c:
            c.put("m", b"y" * 1000)
            assert [s.name for s in c.list()] == ["m"]


@pytest.fixture()
def tls_pair(pki: Pki, tmp_path: Path) -> Iterator[tuple[SnapshotServer, object]]:
    """A snapshot service with mTLS and namespaced keys, and an inference service with
    TLS, keys, and its snapshot client on mTLS with its own namespace key."""
    keys = write_keys(tmp_path / "snap-keys", {"replica-a-key-0123456789": "namespace=a"})
    (tmp_path / "replica.key").write_text("replica-a-key-0123456789\n")
    snap_cfg = SnapshotConfig(data_dir=tmp_path / "data", port=0, api_keys=keys,
                              tls_cert=pki.server[0], tls_key=pki.server[1],
                              tls_client_ca=pki.ca[0])
    with SnapshotServer(snap_cfg) as snap:
        cfg = service_config(
            *model_pair(tmp_path.parent), snapshot_addr=f"localhost:{snap.port}",
            api_keys=write_keys(tmp_path / "keys", {"admin-key-0123456789ab": "admin"}),
            tls_cert=pki.server[0], tls_key=pki.server[1],
            snapshot_tls_ca=pki.ca[0], snapshot_tls_cert=pki.client[0],
            snapshot_tls_key=pki.client[1], snapshot_key_file=tmp_path / "replica.key",
            auto_save=False)
        with running(cfg) as srv:
            yield snap, srv


def test_inference_tls_with_snapshot_mtls(pki: Pki, tls_pair: tuple) -> None:
    snap, srv = tls_pair
    addr = f"localhost:{srv.port}"
    creds = channel_credentials(pki.ca[0])
    with InferenceClient(addr, api_key="admin-key-0123456789ab", credentials=creds) as c:
        c.generate([1, 2, 3], max_tokens=4, id_slot=0)
        saved = c.stub.SaveSlot(ipb.SaveSlotRequest(id_slot=0, filename="s0"), timeout=30)
        assert saved.n_saved > 0
    # the slot is stored in the replica's namespace, reached over mTLS
    assert [s.name for s in snap.store.list("")] == ["a:s0"]
    with InferenceClient(addr, api_key="admin-key-0123456789ab") as plain, \
            pytest.raises(grpc.RpcError) as err:
        plain.tokenize("hi")
    assert err.value.code() == UNAVAILABLE


def test_client_command_line_with_tls_and_key(pki: Pki, tls_pair: tuple, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc.client import main

    _, srv = tls_pair
    (tmp_path / "admin.key").write_text("admin-key-0123456789ab\n")
    base = ["--addr", f"localhost:{srv.port}", "--tls-ca", str(pki.ca[0])]
    assert main([*base, "--api-key-file", str(tmp_path / "admin.key"), "tokenize", "hi"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert main([*base, "tokenize", "hi"]) != 0  # no key
    assert capsys.readouterr().err.startswith("error: UNAUTHENTICATED: this service needs an "
                                              "API key")


def test_snapshot_ctl_with_mtls_and_key_from_the_environment(
        pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The snapshot CLI reads the variables of the inference service's snapshot client:
    an address list (a replica that is down is skipped), the key file, the CA and the
    client certificate."""
    import json
    import socket

    from snapshot_svc.ctl import main

    key = "ctl-replica-key-0123456789"
    keys = write_keys(tmp_path / "snap-keys", {key: "namespace=a"})
    (tmp_path / "replica.key").write_text(key + "\n")
    (tmp_path / "blob").write_bytes(b"x" * 1000)
    with socket.socket() as s:  # a port nothing listens on: the replica that is down
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()[1]
    cfg = SnapshotConfig(data_dir=tmp_path / "data", port=0, api_keys=keys,
                         tls_cert=pki.server[0], tls_key=pki.server[1], tls_client_ca=pki.ca[0])
    with SnapshotServer(cfg) as snap:
        for var, value in (("ADDR", f"localhost:{down},localhost:{snap.port}"),
                           ("KEY_FILE", tmp_path / "replica.key"),
                           ("CLIENT_TLS_CA", pki.ca[0]), ("CLIENT_TLS_CERT", pki.client[0]),
                           ("CLIENT_TLS_KEY", pki.client[1])):
            monkeypatch.setenv(f"WARMSLOT_SNAPSHOT_{var}", str(value))
        assert main(["put", "s1", "--target", str(tmp_path / "blob")]) == 0
        assert json.loads(capsys.readouterr().out)["target"]["size"] == 1000
        assert main(["ls"]) == 0
        assert [s["name"] for s in json.loads(capsys.readouterr().out)] == ["s1"]
        assert [s.name for s in snap.store.list("")] == ["a:s1"]  # the key's namespace
        monkeypatch.delenv("WARMSLOT_SNAPSHOT_KEY_FILE")
        assert main(["ls"]) == 1
        assert json.loads(capsys.readouterr().err)["error"] == "UNAUTHENTICATED"
        monkeypatch.setenv("WARMSLOT_SNAPSHOT_KEY_FILE", str(tmp_path / "replica.key"))
        monkeypatch.delenv("WARMSLOT_SNAPSHOT_CLIENT_TLS_CERT")  # a key without its certificate
        assert main(["ls"]) == 1
        assert json.loads(capsys.readouterr().err) == {
            "error": "INVALID_ARGUMENT",
            "message": "a client certificate needs its key and a key its certificate"}
        assert main(["--tls-cert", str(pki.client[0]), "ls"]) == 0  # the flag works too
        capsys.readouterr()
        monkeypatch.delenv("WARMSLOT_SNAPSHOT_CLIENT_TLS_KEY")  # no client certificate
        assert main(["ls"]) == 1
        assert json.loads(capsys.readouterr().err)["error"] == "UNAVAILABLE"


def test_inference_client_command_line_with_mtls(pki: Pki, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from inference_svc.client import main

    cfg = service_config(*model_pair(tmp_path.parent), tls_cert=pki.server[0],
                         tls_key=pki.server[1], tls_client_ca=pki.ca[0], auto_save=False)
    with running(cfg) as srv:
        base = ["--addr", f"localhost:{srv.port}", "--tls-ca", str(pki.ca[0])]
        assert main([*base, "--tls-cert", str(pki.client[0]), "--tls-key", str(pki.client[1]),
                     "tokenize", "hi"]) == 0
        assert capsys.readouterr().out.strip().startswith("[")
        monkeypatch.setenv("WARMSLOT_CLIENT_TLS_CERT", str(pki.client[0]))
        monkeypatch.setenv("WARMSLOT_CLIENT_TLS_KEY", str(pki.client[1]))
        assert main([*base, "tokenize", "hi"]) == 0  # from the environment
        capsys.readouterr()
        monkeypatch.setenv("WARMSLOT_CLIENT_TLS_CERT", str(pki.stranger[0]))
        monkeypatch.setenv("WARMSLOT_CLIENT_TLS_KEY", str(pki.stranger[1]))
        assert main([*base, "tokenize", "hi"]) == 1  # a certificate of another CA
        assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


def test_client_and_server_certificate_variables_are_distinct(pki: Pki, tmp_path: Path) -> None:
    """One environment for both services: the snapshot service's own certificate
    variables do not configure the inference service's snapshot client, and the
    client's do not configure the snapshot service."""
    from inference_svc.config import from_args
    from snapshot_svc.config import parse_config

    server_vars = {"WARMSLOT_SNAPSHOT_TLS_CERT": str(pki.server[0]),
                   "WARMSLOT_SNAPSHOT_TLS_KEY": str(pki.server[1])}
    client_vars = {"WARMSLOT_SNAPSHOT_CLIENT_TLS_CA": str(pki.ca[0]),
                   "WARMSLOT_SNAPSHOT_CLIENT_TLS_CERT": str(pki.client[0]),
                   "WARMSLOT_SNAPSHOT_CLIENT_TLS_KEY": str(pki.client[1])}
    env = {**server_vars, **client_vars}
    inf = from_args([], env)
    assert (inf.snapshot_tls_ca, inf.snapshot_tls_cert, inf.snapshot_tls_key) == (
        pki.ca[0], pki.client[0], pki.client[1])
    assert (inf.tls_cert, inf.tls_key) == (None, None)
    snap = parse_config(["--data-dir", str(tmp_path)], env)
    assert (snap.tls_cert, snap.tls_key, snap.tls_client_ca) == (pki.server[0], pki.server[1],
                                                                 None)
    assert from_args([], server_vars).snapshot_tls_cert is None


def _scrape(url: str, ctx: object = None, key: str | None = None) -> tuple[int, str]:
    import ssl
    import urllib.error
    import urllib.request

    assert ctx is None or isinstance(ctx, ssl.SSLContext)
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _tls_context(pki: Pki, client: tuple[Path, Path] | None) -> object:
    import ssl

    ctx = ssl.create_default_context(cafile=str(pki.ca[0]))
    if client is not None:
        ctx.load_cert_chain(str(client[0]), str(client[1]))
    return ctx


def test_snapshot_metrics_need_mtls_and_an_admin_key(pki: Pki, tmp_path: Path) -> None:
    import socket
    import ssl
    import urllib.error

    from tests.test_service_api import _free_port

    admin, tenant = "metrics-admin-key-012345", "metrics-tenant-key-01234"
    keys = write_keys(tmp_path / "keys", {admin: "admin", tenant: "namespace=t"})
    port = _free_port()
    cfg = SnapshotConfig(data_dir=tmp_path / "data", port=0, api_keys=keys,
                         tls_cert=pki.server[0], tls_key=pki.server[1], tls_client_ca=pki.ca[0],
                         metrics_port=port)
    with SnapshotServer(cfg) as snap:
        assert snap.metrics_port == port
        url = f"https://localhost:{port}/metrics"
        ok = _tls_context(pki, pki.client)
        status, body = _scrape(url, ok, admin)
        assert status == 200 and "warmslot_snapshot_" in body
        assert _scrape(url, ok) == (401, "this service needs an API key: send the metadata "
                                         "'authorization: Bearer <key>'\n")
        assert _scrape(url, ok, "unknown-key-0123456789")[0] == 401
        assert _scrape(url, ok, tenant) == (403, "the metrics need an admin API key\n")
        for ctx in (_tls_context(pki, None), _tls_context(pki, pki.stranger)):  # no/bad cert
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                _scrape(url, ctx, admin)
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to TLS
            _scrape(f"http://localhost:{port}/metrics", None, admin)
        with socket.create_connection(("127.0.0.1", port)):  # a silent client...
            assert _scrape(url, ok, admin)[0] == 200  # ...holds up no one
        assert snap.metrics_port == port


def test_inference_metrics_over_tls_with_an_admin_key(pki: Pki, tmp_path: Path) -> None:
    from tests.test_service_api import _free_port

    admin, user = "metrics-admin-key-012345", "metrics-user-key-0123456"
    cfg = service_config(*model_pair(tmp_path.parent), tls_cert=pki.server[0],
                         tls_key=pki.server[1], metrics_port=_free_port(), auto_save=False,
                         api_keys=write_keys(tmp_path / "keys", {admin: "admin", user: "user"}))
    with running(cfg) as srv:
        url = f"https://localhost:{srv.metrics_port}/metrics"
        ctx = _tls_context(pki, None)
        status, body = _scrape(url, ctx, admin)
        assert status == 200 and "warmslot_requests" in body
        assert _scrape(url, ctx, user) == (403, "the metrics need an admin API key\n")
        assert _scrape(url, ctx)[0] == 401


def test_metrics_on_a_public_address_need_keys_or_tls(tmp_path: Path) -> None:
    from inference_svc.config import Config

    refused = ("refusing to listen on 0.0.0.0 without API keys or TLS: anyone who reaches the "
               "metrics endpoint (--metrics-host) could read them")
    with pytest.raises(ValueError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        Config(metrics_port=9090, metrics_host="0.0.0.0")
    with pytest.raises(ValueError, match="--metrics-host"):
        SnapshotConfig(data_dir=tmp_path, metrics_port=9091, metrics_host="0.0.0.0")
    assert Config(metrics_port=9090, metrics_host="0.0.0.0", insecure=True).metrics_port == 9090
    assert SnapshotConfig(data_dir=tmp_path, metrics_port=9091, metrics_host="0.0.0.0",
                          api_keys=tmp_path / "keys").metrics_host == "0.0.0.0"
    assert Config(metrics_port=9090).metrics_host == "127.0.0.1"  # loopback by default
    assert SnapshotConfig(data_dir=tmp_path, metrics_port=9091).metrics_host == "127.0.0.1"
