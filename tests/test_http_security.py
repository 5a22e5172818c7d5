"""The HTTP door's security: the --api-keys file's bearer keys and roles (a user key's
sessions are its own, whichever door it comes through; one key's streams counted over
both doors), TLS and mutual TLS from the service's certificate flags, and the refusal of
an open non-loopback address, as gRPC's; the flags' environment variables."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from inference_svc import config
from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from tests.fixtures.servicekit import running
from tests.httpkit import MODEL_ID, client, error, http_config, post, raw
from tests.seckit import make_ca, make_cert, write_keys

USER, OTHER, ADMIN = "u" * 20, "o" * 20, "a" * 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("http-keys")
    keys = write_keys(d / "keys", {USER: "user", OTHER: "user", ADMIN: "admin"})
    with running(http_config(d, api_keys=keys, max_streams_per_key=1)) as srv:
        yield srv


def test_keys(server: Server) -> None:
    body = {"prompt": "x = ", "max_tokens": 1}
    assert post(server, "/v1/completions", body) == error(
        401, "this service needs an API key: send the metadata 'authorization: Bearer <key>'",
        "unauthenticated")
    assert post(server, "/v1/completions", body, Authorization="Bearer " + "z" * 20) == error(
        401, "unknown API key", "unauthenticated")
    status, headers, _ = raw(server, "GET", "/v1/models")
    assert (status, headers["www-authenticate"]) == (401, "Bearer")
    for key in (USER, ADMIN):
        oa = client(server, key)
        assert oa.completions.create(model=MODEL_ID, prompt="x = ", max_tokens=2).usage \
            .completion_tokens == 2
        assert [m.id for m in oa.models.list().data] == [MODEL_ID]
    with pytest.raises(openai.AuthenticationError) as err:
        client(server, "nope" * 5).models.list()
    assert err.value.status_code == 401
    assert raw(server, "GET", "/health")[0] == 200  # health stays open


def test_sessions_belong_to_keys(server: Server) -> None:
    """A user key's session is its own: another key's session of the same name is a
    new one; the owner continues its own through either door."""
    def turn(key: str, prompt: str) -> dict[str, object]:
        status, answer = post(server, "/v1/completions",
                              {"prompt": prompt, "max_tokens": 3, "temperature": 0},
                              Authorization=f"Bearer {key}", **{"X-Session-Id": "shared"})
        assert status == 200, answer
        return answer["timings"]

    first = turn(USER, "def f(x):")
    assert (first["session_tier"], first["cache_n"]) == ("new", 0)
    assert turn(OTHER, "def g(y):")["session_tier"] == "new"
    again = turn(USER, " return x")
    assert again["session_tier"] == "slot"
    assert again["cache_n"] == first["prompt_n"] + first["predicted_n"]
    with InferenceClient(f"127.0.0.1:{server.port}", api_key=OTHER) as c:
        _, last = c.generate(" return y", session="shared", max_tokens=1)
    assert last.timings.session_tier == 2  # slot: the key's own, from the HTTP turn


def test_stream_limit_counts_both_doors(server: Server) -> None:
    """--max-streams-per-key 1: a key with a gRPC stream open gets 429 over HTTP."""
    with InferenceClient(f"127.0.0.1:{server.port}", api_key=USER) as c:
        from inference_svc.client import make_request

        stream = c.generate_stream(make_request("class A:", max_tokens=400, temperature=0.0))
        next(stream)
        try:
            assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                        Authorization=f"Bearer {USER}") == error(
                429, "this key has 1 streams open, the limit is 1 (--max-streams-per-key)",
                "resource_exhausted")
            assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                        Authorization=f"Bearer {ADMIN}")[0] == 200
        finally:
            stream.cancel()


def test_tls_and_mtls(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "ca")
    cert, key = make_cert(tmp_path, "server", ca)
    ccert, ckey = make_cert(tmp_path, "client", ca)
    ctx = ssl.create_default_context(cafile=str(ca[0]))
    with running(http_config(tmp_path, tls_cert=cert, tls_key=key, slots=1)) as srv:
        url = f"https://127.0.0.1:{srv.http_port}/v1"
        oa = openai.OpenAI(base_url=url, api_key="x", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ctx))
        assert oa.completions.create(model=MODEL_ID, prompt="x", max_tokens=1).choices
        with pytest.raises(openai.APIConnectionError):  # the client does not trust it
            openai.OpenAI(base_url=url, api_key="x", max_retries=0).models.list()
    with running(http_config(tmp_path, tls_cert=cert, tls_key=key, tls_client_ca=ca[0],
                             slots=1)) as srv:
        url = f"https://127.0.0.1:{srv.http_port}/v1"
        with pytest.raises(openai.APIConnectionError):  # no client certificate
            openai.OpenAI(base_url=url, api_key="x", max_retries=0,
                          http_client=openai.DefaultHttpxClient(verify=ctx)).models.list()
        mctx = ssl.create_default_context(cafile=str(ca[0]))
        mctx.load_cert_chain(str(ccert), str(ckey))
        oa = openai.OpenAI(base_url=url, api_key="x", max_retries=0,
                           http_client=httpx2.Client(verify=mctx))
        assert [m.id for m in oa.models.list().data] == [MODEL_ID]


def test_open_address_refused_like_grpc(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without API keys or "
                                         "TLS: anyone who reaches the HTTP port"):
        config.Config(http_port=0, http_host="0.0.0.0")
    config.Config(http_port=0, http_host="0.0.0.0", insecure=True)
    keys = write_keys(tmp_path / "k", {USER: "user"})
    config.Config(http_port=0, http_host="0.0.0.0", api_keys=keys)
    config.Config(http_port=None, http_host="0.0.0.0")  # no HTTP door: nothing to refuse
    with pytest.raises(ValueError, match="ports must be in 0..65535"):
        config.Config(http_port=70000)


def test_flags_and_environment() -> None:
    cfg = config.from_args([], {"WARMSLOT_HTTP_PORT": "8080", "WARMSLOT_HTTP_HOST": "::1"})
    assert (cfg.http_port, cfg.http_host) == (8080, "::1")
    cfg = config.from_args(["--http-port", "0"], {"WARMSLOT_HTTP_PORT": "8080"})
    assert cfg.http_port == 0
    assert config.from_args([], {}).http_port is None
