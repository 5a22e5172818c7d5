"""Inference input bounds: texts over --max-prompt-bytes refused before tokenizing,
tokenization on its own bounded pool, undecodable request bytes INVALID_ARGUMENT on
every method of the inference service."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.errors import InvalidArgument, ResourceExhausted
from inference_svc.pb import inference_pb2 as ipb
from inference_svc.prompts import BoundedTokenizer
from tests.fixtures.servicekit import model_pair, running, service_config
from tests.seckit import code_of, methods, raw_call

INVALID = grpc.StatusCode.INVALID_ARGUMENT
INFERENCE = ipb.DESCRIPTOR.services_by_name["Inference"]
LIMIT = 4096


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = service_config(*model_pair(tmp_path_factory.getbasetemp()),
                         slot_save_path=tmp_path_factory.mktemp("inputs") / "slots",
                         max_prompt_bytes=LIMIT)
    with running(cfg) as srv:
        yield srv


def test_prompt_over_the_limit_is_refused(server: Server) -> None:
    with InferenceClient(f"127.0.0.1:{server.port}", timeout=30) as c:
        assert len(c.tokenize("é" * (LIMIT // 2))) > 0  # exactly the limit: served
        for call in (lambda: c.tokenize("é" * (LIMIT // 2) + "a"),
                     lambda: c.generate("é" * (LIMIT // 2) + "a", max_tokens=1)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == INVALID
            assert err.value.details() == (f"the text is {LIMIT + 1} bytes, the limit is "
                                           f"{LIMIT} (--max-prompt-bytes)")


def test_undecodable_request_bytes_are_invalid_argument(server: Server) -> None:
    # field 1 as a length-delimited field holding bytes that are not UTF-8: where field
    # 1 is a string (Tokenize's text, Generate's prompt) the message does not parse
    bad = b"\x0a\x02\xff\xfe"
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        for path, cs, ss in methods(INFERENCE):
            name = path.rsplit("/", 1)[-1]
            code = code_of(raw_call, ch, path, cs, ss, request=bad)
            assert code != grpc.StatusCode.INTERNAL, path
            if name in ("Tokenize", "Generate"):
                assert code == INVALID, path
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(f"/{INFERENCE.full_name}/Tokenize")(bad, timeout=10)
        assert err.value.details().startswith("malformed request: ")


class _SlowTokenizer:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def encode_ids(self, text: str, limit: int | None) -> array[int]:
        self.started.set()
        self.release.wait(30)
        return array("i", [len(text)])


def test_tokenizer_pool_is_bounded() -> None:
    slow = _SlowTokenizer()
    tok = BoundedTokenizer(slow, max_bytes=100, threads=1, max_waiting=1)  # type: ignore[arg-type]
    results: list[list[int]] = []
    first = threading.Thread(target=lambda: results.append(tok.encode("aa")))
    first.start()
    assert slow.started.wait(10)
    second = threading.Thread(target=lambda: results.append(tok.encode("bbb")))
    second.start()
    # one tokenizing, one admitted to wait: a third is refused at once
    for _ in range(1000):
        try:
            tok.encode("c")
        except ResourceExhausted as exc:
            assert exc.message == "too many texts waiting to be tokenized; retry later"
            break
        results.clear()  # the second had not been admitted yet
    else:
        pytest.fail("never refused")
    with pytest.raises(InvalidArgument):
        tok.encode("x" * 101)
    slow.release.set()
    first.join(10)
    second.join(10)
    assert sorted(results) == [[2], [3]]
    tok.close()


def test_tokenizer_thread_is_not_the_callers(tmp_path: Path) -> None:
    names: list[str] = []

    class Tok:
        def encode_ids(self, text: str, limit: int | None) -> array[int]:
            names.append(threading.current_thread().name)
            return array("i", [1])

    tok = BoundedTokenizer(Tok(), 10, 1, 1)  # type: ignore[arg-type]
    assert tok.encode("a") == [1]
    assert names[0].startswith("tokenize") and names[0] != threading.current_thread().name
    tok.close()


def test_top_k_above_the_vocabulary_is_the_whole_vocabulary(server: Server) -> None:
    with InferenceClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        def tokens(top_k: int) -> list[int]:
            rs, _ = c.generate([5, 6, 7], max_tokens=12, temperature=1.0, top_k=top_k,
                               top_p=1.0, min_p=0.0, seed=7, speculative=False,
                               cache_prompt=False)
            return [t for r in rs for t in r.tokens]

        whole = tokens(0)  # 0: top-k off
        assert len(whole) == 12
        assert tokens(c.info().n_vocab) == whole
        assert tokens(2**31 - 1) == whole
