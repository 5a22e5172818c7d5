"""The API surface through real gRPC: every bad input gets its status code (and the
server keeps serving), generation options, info, tokenizer, health, reflection,
metrics."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_request
from inference_svc.core.params import SamplingParams
from inference_svc.pb import inference_pb2 as pb
from tests.fixtures.servicekit import Reference, model_pair, running, service_config

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PROMPT = "hello there, general kenobi"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = service_config(*pair, slot_save_path=tmp_path_factory.mktemp("api-slots"),
                         metrics_port=_free_port())
    with running(cfg) as srv:
        yield srv


@pytest.fixture()
def client(server: Server) -> Iterator[InferenceClient]:
    with InferenceClient(f"127.0.0.1:{server.port}", timeout=30) as c:
        yield c


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _gen(c: InferenceClient, prompt: object = PROMPT, **kw: object) -> Callable[[], object]:
    return lambda: c.generate(prompt, **kw)  # type: ignore[arg-type]


BAD_GENERATE = [
    ("both prompts", dict(), "prompt or prompt_tokens"),
    ("empty prompt", dict(prompt=""), "empty"),
    ("token too big", dict(prompt=[1, 300]), "300"),
    ("negative token", dict(prompt=[-1]), "-1"),
    ("slot too big", dict(id_slot=2), "id_slot 2"),
    ("slot negative", dict(id_slot=-2), "id_slot -2"),
    ("negative max_tokens", dict(max_tokens=-1), "max_tokens"),
    ("context overflow", dict(max_tokens=250), "exceed the context of 256"),
    ("temperature < 0", dict(temperature=-0.5), "temperature"),
    ("temperature > 100", dict(temperature=101.0), "temperature"),
    ("temperature nan", dict(temperature=math.nan), "temperature"),
    ("top_k < 0", dict(top_k=-1), "top_k"),
    ("top_p 0", dict(top_p=0.0), "top_p"),
    ("top_p > 1", dict(top_p=1.5), "top_p"),
    ("min_p 1", dict(min_p=1.0), "min_p"),
    ("n_max 17", dict(n_max=17), "n_max"),
    ("n_min > n_max", dict(n_max=2, n_min=3), "n_min"),
    ("p_min > 1", dict(p_min=1.5), "p_min"),
    ("empty stop", dict(stop=[""]), "stop string"),
    ("too many stops", dict(stop=[str(i) for i in range(17)]), "stop strings"),
]


@pytest.mark.parametrize("case, kw, words", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_requests(client: InferenceClient, case: str, kw: dict[str, object],
                               words: str) -> None:
    kw = dict(kw)
    prompt = kw.pop("prompt", PROMPT)
    if case == "both prompts":
        req = make_request(PROMPT, max_tokens=4)
        req.prompt_tokens.extend([1, 2])
        call = lambda: list(client.generate_stream(req))  # noqa: E731
    else:
        call = _gen(client, prompt, **({"max_tokens": 4} | kw))
    code, details = _code(call)
    assert code == INVALID, details
    assert words in details


def test_context_overflow_message_has_the_numbers(client: InferenceClient) -> None:
    toks = client.tokenize(PROMPT)
    code, details = _code(_gen(client, max_tokens=250))
    assert code == INVALID
    assert f"prompt of {len(toks)} tokens plus max_tokens 250 exceed the context of 256" in details


def test_truncate_prompt_drops_the_oldest_tokens(client: InferenceClient,
                                                 pair: tuple[Path, Path]) -> None:
    prompt = [(7 * i) % 250 + 1 for i in range(250)]
    rs, last = client.generate(prompt, max_tokens=10, temperature=0.0, truncate_prompt=True,
                               id_slot=0, cache_prompt=False)
    assert last.timings.n_truncated == 4
    assert last.timings.prompt_n == 246
    tokens = [t for r in rs for t in r.tokens]
    assert tokens == Reference(*pair).generate(prompt[4:], 10)


LONG_TEXT = "the tea ate in the sea, 42 times! " * 4000  # 136 000 characters: 5 pieces


def test_long_text_prompt_stops_past_the_context(client: InferenceClient) -> None:
    code, details = _code(_gen(client, LONG_TEXT, max_tokens=4))
    assert code == INVALID
    assert details == ("the prompt of more than 256 tokens plus max_tokens 4 exceed the context "
                       "of 256 tokens (set truncate_prompt to drop the oldest prompt tokens)")


def test_long_text_prompt_truncated_keeps_its_last_tokens(client: InferenceClient,
                                                          pair: tuple[Path, Path]) -> None:
    toks = client.tokenize(LONG_TEXT)  # every token of the text, in pieces
    assert len(toks) > 10_000
    rs, last = client.generate(LONG_TEXT, max_tokens=4, temperature=0.0, truncate_prompt=True,
                               id_slot=0, cache_prompt=False)
    assert last.timings.n_truncated == len(toks) + 4 - 256
    assert last.timings.prompt_n == 252
    assert [t for r in rs for t in r.tokens] == Reference(*pair).generate(toks[-252:], 4)


@pytest.mark.parametrize("rpc", ["save", "restore", "erase"])
@pytest.mark.parametrize("slot", [-1, 2, 1000])
def test_bad_slot_ids(client: InferenceClient, rpc: str, slot: int) -> None:
    call = {"save": lambda: client.save(slot, "f"), "restore": lambda: client.restore(slot, "f"),
            "erase": lambda: client.erase(slot)}[rpc]
    code, details = _code(call)
    assert code == INVALID and f"id_slot {slot}" in details


BAD_NAMES = [
    ("empty", ""), ("slash", "a/b"), ("backslash", "a\\b"), ("dotdot", ".."),
    ("dotdot inside", "a..b"), ("control", "a\x01b"), ("newline", "a\nb"), ("del", "a\x7fb"),
    ("leading space", " a"), ("trailing space", "a "), ("trailing dot", "a."),
    ("too long", "x" * 256), ("too long utf8", "é" * 128),
]


@pytest.mark.parametrize("rpc", ["save", "restore"])
@pytest.mark.parametrize("case, name", BAD_NAMES, ids=[c[0] for c in BAD_NAMES])
def test_bad_file_names(client: InferenceClient, rpc: str, case: str, name: str) -> None:
    call = {"save": lambda: client.save(0, name), "restore": lambda: client.restore(0, name)}[rpc]
    code, details = _code(call)
    assert code == INVALID, details
    assert "bad slot file name" in details


def test_good_unusual_names(client: InferenceClient) -> None:
    client.generate(PROMPT, max_tokens=2, id_slot=0)
    for name in ("a", ".hidden", "with space", "ünïcødé-名前", "x" * 250, "a.drft.b", ".tmp"):
        assert client.save(0, name).n_saved > 0
        assert client.restore(1, name).n_restored > 0
    # names of the local store's own files ('a.b.drft' is the sidecar of 'a.b')
    for name in ("a.b.drft", ".tmp-x", ".pending-x"):
        code, details = _code(lambda n=name: client.save(0, n))
        assert code == INVALID and "the local store's own files" in details


def test_detokenize_rejects_unknown_ids(client: InferenceClient) -> None:
    code, details = _code(lambda: client.detokenize([1, 300]))
    assert code == INVALID and "300" in details


def test_server_keeps_serving_after_bad_requests(client: InferenceClient,
                                                 pair: tuple[Path, Path]) -> None:
    for kw in BAD_GENERATE:
        try:
            client.generate(PROMPT, **({"max_tokens": 4} | {k: v for k, v in kw[1].items()
                                                            if k != "prompt"}))
        except grpc.RpcError:
            pass
    toks = client.tokenize(PROMPT)
    rs, last = client.generate(PROMPT, max_tokens=6, temperature=0.0, id_slot=0,
                               cache_prompt=False)
    assert [t for r in rs for t in r.tokens] == Reference(*pair).generate(toks, 6)


def test_tokenize_detokenize_roundtrip(client: InferenceClient) -> None:
    toks = client.tokenize(PROMPT)
    assert toks and client.detokenize(toks) == PROMPT


def test_info(client: InferenceClient, server: Server, pair: tuple[Path, Path]) -> None:
    info = client.info()
    assert (info.n_slots, info.n_ctx, info.n_vocab) == (2, 256, 300)
    assert info.model.name == "test-target" and len(info.model.fingerprint) == 64
    assert info.draft.name == "test-draft" and info.draft.fingerprint != info.model.fingerprint
    assert (info.slot_file_version, info.draft_file_version) == (2, 2)
    assert (info.snapshot_protocol_min, info.snapshot_protocol_max) == (1, 2)
    assert info.store_configured and info.store.startswith("local:")
    assert info.draft_restore_policy == "reprefill"
    assert info.default_speculative.enabled and info.default_speculative.n_max == 8
    assert info.default_sampling.top_k == 40
    assert info.eos_id == 299


def test_generation_options(client: InferenceClient, pair: tuple[Path, Path]) -> None:
    ref = Reference(*pair)
    toks = client.tokenize(PROMPT)
    greedy = ref.generate(toks, 20)
    for spec in (dict(speculative=False), dict(n_max=1), dict(n_max=16, p_min=0.2), {}):
        rs, last = client.generate(PROMPT, max_tokens=20, temperature=0.0, **spec)
        assert [t for r in rs for t in r.tokens] == greedy, spec
        assert "".join(r.text for r in rs) == client.detokenize(greedy)
        if spec == dict(speculative=False):
            assert last.timings.draft_n == 0
        if spec == dict(n_max=1):
            assert 0 < last.timings.draft_n <= last.timings.n_steps
    # max_tokens 0 processes the prompt only; it stays in the slot
    rs, last = client.generate(PROMPT, max_tokens=0, id_slot=1, cache_prompt=False)
    assert len(rs) == 1 and not rs[0].tokens and last.timings.prompt_n == len(toks)
    assert client.slots()[1].n_tokens == len(toks)
    # sampling with a seed is reproducible, with and without speculation
    runs = []
    for spec in (True, False, True):
        rs, last = client.generate(PROMPT, max_tokens=20, temperature=0.8, seed=42,
                                   speculative=spec)
        runs.append([t for r in rs for t in r.tokens])
        assert last.seed == 42
    assert runs[0] == runs[2]
    sp = SamplingParams(0.8, 40, 0.95, 0.05)
    assert runs[1] == ref.generate(toks, 20, sampling=sp, seed=42)


def test_stop_strings(client: InferenceClient, pair: tuple[Path, Path]) -> None:
    toks = client.tokenize(PROMPT)
    full = Reference(*pair).generate(toks, 40)
    # a stop string: the text of two tokens that first occurs right after token i
    for i in range(1, 38):
        prefix, stop = client.detokenize(full[:i]), client.detokenize(full[i:i + 2])
        if len(stop) >= 2 and stop.isascii() and stop.isprintable() and stop not in prefix \
                and client.detokenize(full[:i + 2]).find(stop) == len(prefix):
            break
    else:
        pytest.fail("no usable stop string in the reference output")
    rs, last = client.generate(PROMPT, max_tokens=40, temperature=0.0, stop=["\x00zz", stop],
                               id_slot=0, cache_prompt=False)
    assert last.stop_reason == pb.STOP_REASON_STOP_STRING and last.stop_string == stop
    assert [t for r in rs for t in r.tokens] == full[:i + 2]
    assert "".join(r.text for r in rs) == prefix
    assert client.slots()[0].n_tokens == len(toks) + i + 2


def test_health_and_reflection(server: Server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "warmslot.inference.v1.Inference"):
            r = h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=5)))
        names = {s.name for s in resp.list_services_response.service}
        assert {"warmslot.inference.v1.Inference", "grpc.health.v1.Health"} <= names


def test_not_serving_while_loading(pair: tuple[Path, Path]) -> None:
    srv = Server(service_config(*pair))
    srv.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            h = health_pb2_grpc.HealthStub(ch)
            r = h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with InferenceClient(f"127.0.0.1:{srv.port}", timeout=5) as c:
                code, details = _code(lambda: c.generate(PROMPT))
                assert code == grpc.StatusCode.UNAVAILABLE and "loading" in details
            srv.load()
            r = h.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop(0)


def test_metrics_endpoint(client: InferenceClient, server: Server) -> None:
    client.generate(PROMPT, max_tokens=4)
    client.save(0, "m")
    client.restore(1, "m")
    try:
        client.restore(1, "no-such-file")
    except grpc.RpcError:
        pass
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    for needle in ('warmslot_requests_total{code="OK",method="Generate"}',
                   'warmslot_requests_total{code="NOT_FOUND",method="RestoreSlot"}',
                   'warmslot_tokens_total{kind="predicted"}',
                   'warmslot_tokens_total{kind="drafted"}',
                   "warmslot_decode_tokens_per_second_bucket", "warmslot_prompt_seconds_count",
                   'warmslot_slot_saves_total{result="ok"}',
                   'warmslot_slot_restores_total{draft_policy="sidecar",result="ok"}',
                   "warmslot_slot_restore_seconds_count", "warmslot_slots_busy"):
        assert needle in body, needle
