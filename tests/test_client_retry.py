"""The client library sends a request again when its stream was cut, only where that
cannot keep a turn twice (a session turn: with its turn_id, to a server that keeps turn
ids), and within the request's one deadline (inference_svc.client)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from inference_svc.client import InferenceClient, make_chat_request, resendable
from inference_svc.pb import inference_pb2 as pb
from inference_svc.pb import inference_pb2_grpc as pb_grpc
from inference_svc.sessions.names import TURN_IDS_HEADER


class Cutting(pb_grpc.InferenceServicer):
    """Fails the first `cuts` calls with `code`/`details` after one token, then answers.
    `turn_ids`: says in its initial metadata that it keeps turn ids, as the server does."""

    def __init__(self, cuts: int, code: grpc.StatusCode, details: str,
                 turn_ids: bool = False) -> None:
        self.cuts, self.code, self.details = cuts, code, details
        self.turn_ids = turn_ids
        self.calls: list[str] = []
        self.ids: list[str] = []  # each call's turn_id

    def _answer(self, kind: str, context: Any) -> Iterator[pb.GenerateResponse]:
        self.calls.append(kind)
        if self.turn_ids:
            context.send_initial_metadata(((TURN_IDS_HEADER, "1"),))
        yield pb.GenerateResponse(text="A")
        if len(self.calls) <= self.cuts:
            context.abort(self.code, self.details)
        yield pb.GenerateResponse(text="B", done=True)

    def Generate(self, request: pb.GenerateRequest, context: Any) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        self.ids.append(request.turn_id)
        return self._answer("generate", context)

    def Chat(self, request: pb.ChatRequest, context: Any) -> Iterator[pb.GenerateResponse]:  # noqa: N802
        self.ids.append(request.turn_id)
        return self._answer("chat", context)


def serve(servicer: Cutting) -> tuple[grpc.Server, InferenceClient]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, InferenceClient(f"127.0.0.1:{port}", timeout=10.0)


REMOVED = (grpc.StatusCode.UNKNOWN, "Stream removed")
UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, "the server is stopping")


@pytest.mark.parametrize("cut", [REMOVED, UNAVAILABLE])
@pytest.mark.parametrize("call", ["generate", "chat", "chat-session"])
def test_a_cut_resendable_request_is_sent_again(cut: tuple[grpc.StatusCode, str],
                                                call: str) -> None:
    servicer = Cutting(2, *cut)
    server, client = serve(servicer)
    try:
        if call == "generate":
            responses, last = client.generate("hi", max_tokens=2)
        else:
            responses, last = client.chat([("user", "hi")], max_tokens=2,
                                          session="s1" if call == "chat-session" else None)
        assert [r.text for r in responses] == ["A", "B"] and last.done
        assert servicer.calls == [call.split("-")[0]] * 3
    finally:
        client.close()
        server.stop(None)


@pytest.mark.parametrize("call", ["generate-session", "chat-append"])
def test_a_cut_session_turn_is_sent_again_with_its_id_to_a_server_that_keeps_ids(
        call: str) -> None:
    servicer = Cutting(2, *REMOVED, turn_ids=True)
    server, client = serve(servicer)
    try:
        if call == "generate-session":
            responses, last = client.generate("hi", max_tokens=2, session="s1")
        else:
            responses, last = client.chat([("user", "hi")], max_tokens=2, session="s1",
                                          append=True)
        assert [r.text for r in responses] == ["A", "B"] and last.done
        assert len(servicer.ids) == 3 and len(set(servicer.ids)) == 1
        assert len(servicer.ids[0]) == 32  # uuid4().hex
        servicer.calls.clear()
        servicer.ids.clear()
        client.generate("hi", max_tokens=2, session="s1", turn_id="mine")
        assert servicer.ids == ["mine"] * 3
    finally:
        client.close()
        server.stop(None)


@pytest.mark.parametrize("call", ["generate-session", "chat-append"])
def test_a_cut_turn_that_may_have_been_kept_is_not_sent_again(call: str) -> None:
    """A server that does not say it keeps turn ids (an older one) would keep the turn
    sent again as a second turn."""
    servicer = Cutting(1, *REMOVED)
    server, client = serve(servicer)
    try:
        with pytest.raises(grpc.RpcError) as err:
            if call == "generate-session":
                client.generate("hi", max_tokens=2, session="s1")
            else:
                client.chat([("user", "hi")], max_tokens=2, session="s1", append=True)
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert len(servicer.calls) == 1
    finally:
        client.close()
        server.stop(None)


def test_retries_end_and_other_errors_are_not_retried() -> None:
    servicer = Cutting(3, *UNAVAILABLE)  # one more cut than the two retries
    server, client = serve(servicer)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hi")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(servicer.calls) == 3
        servicer.calls.clear()
        servicer.code, servicer.details = grpc.StatusCode.INVALID_ARGUMENT, "bad"
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hi")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(servicer.calls) == 1
        servicer.calls.clear()
        servicer.code, servicer.details = grpc.StatusCode.UNKNOWN, "an exception"
        with pytest.raises(grpc.RpcError):
            client.generate("hi")
        assert len(servicer.calls) == 1
    finally:
        client.close()
        server.stop(None)


def test_resendable() -> None:
    assert resendable(pb.GenerateRequest(prompt="x"))
    assert not resendable(pb.GenerateRequest(prompt="x", session="s"))
    assert not resendable(pb.GenerateRequest(prompt="x", session="s"), turn_ids=True)
    assert not resendable(pb.GenerateRequest(prompt="x", session="s", turn_id="t"))
    assert resendable(pb.GenerateRequest(prompt="x", session="s", turn_id="t"), turn_ids=True)
    assert resendable(make_chat_request([("user", "x")], session="s"))
    assert not resendable(make_chat_request([("user", "x")], session="s", append=True))
    assert resendable(make_chat_request([("user", "x")], session="s", append=True,
                                        turn_id="t"), turn_ids=True)
