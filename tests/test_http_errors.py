"""Bad requests to the HTTP door: each gets its exact status and OpenAI's error object
naming the problem (the same message as the gRPC status of the same request where gRPC
can send it), and the server keeps serving."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from inference_svc.api.server import Server
from inference_svc.client import make_request
from tests.fixtures.servicekit import running
from tests.httpkit import MODEL_ID, client, error, grpc_client, http_config, post, raw

C, CC = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "def f(x):", "max_tokens": 2}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("http-errors")
    with running(http_config(d, max_prompt_bytes=1000, slots=1, max_queue=1,
                             max_queue_wait=0.5)) as srv:
        yield srv


def _bad(field: str, message: str) -> tuple[int, object]:
    return error(400, message, "invalid_argument", field)


JSON_ERRORS = [
    ("not json", C, "{", error(400, "the request body is not valid JSON: Expecting property "
                                    "name enclosed in double quotes: line 1 column 2 (char 1)",
                               "invalid_argument")),
    ("empty body", C, "", error(400, "the request body is empty: a JSON object is needed",
                                "invalid_argument")),
    ("array body", C, "[1]", error(400, "the request body must be a JSON object, not an array",
                                   "invalid_argument")),
    ("NaN", C, '{"prompt": "x", "temperature": NaN}',
     error(400, "the request body is not valid JSON: NaN is not a JSON number",
           "invalid_argument")),
    ("bad utf-8", C, b'{"prompt": "\xff"}',
     error(400, "the request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in "
                "position 12: invalid start byte", "invalid_argument")),
    ("duplicate", C, '{"prompt": "x", "prompt": "y"}',
     _bad("prompt", "the field 'prompt' appears twice")),
]


@pytest.mark.parametrize("path,body,expected", [c[1:] for c in JSON_ERRORS],
                         ids=[c[0] for c in JSON_ERRORS])
def test_malformed_bodies(server: Server, path: str, body: str, expected: object) -> None:
    assert post(server, path, body) == expected


FIELD_ERRORS = [
    ("unknown field", C, {**OK, "foo": 1}, _bad("foo", "unknown field 'foo'")),
    ("string temperature", C, {**OK, "temperature": "hot"},
     _bad("temperature", "temperature must be a number, not a string")),
    ("bool max_tokens", C, {**OK, "max_tokens": True},
     _bad("max_tokens", "max_tokens must be an integer, not a boolean")),
    ("float max_tokens", C, {**OK, "max_tokens": 1.5},
     _bad("max_tokens", "max_tokens must be an integer, not a number")),
    ("huge max_tokens", C, {**OK, "max_tokens": 1 << 40},
     _bad("max_tokens", "max_tokens 1099511627776 is outside -2147483648..2147483647")),
    ("negative seed", C, {**OK, "seed": -1},
     _bad("seed", "seed -1 is outside 0..18446744073709551615")),
    ("n 2", C, {**OK, "n": 2},
     _bad("n", "n 2 is not supported: one choice per request (n must be 1)")),
    ("echo", C, {**OK, "echo": True},
     _bad("echo", "echo true is not supported: the response never repeats the prompt")),
    ("two prompts", C, {**OK, "prompt": ["a", "b"]},
     _bad("prompt", "prompt holds 2 prompts: this server takes one per request")),
    ("no prompt", C, {"max_tokens": 2},
     _bad("prompt", "prompt must be a string or an array of token ids, not null")),
    ("stop number", C, {**OK, "stop": 5},
     _bad("stop", "stop must be a string or an array of strings, not an integer")),
    ("stream_options alone", C, {**OK, "stream_options": {"include_usage": True}},
     _bad("stream_options", "stream_options needs stream: true")),
    ("stream_options unknown", C, {**OK, "stream": True, "stream_options": {"x": 1}},
     _bad("stream_options.x", "unknown field 'stream_options.x'")),
    ("speculative unknown", C, {**OK, "speculative": {"n": 1}},
     _bad("speculative.n", "unknown field 'speculative.n'")),
    ("logprobs 21", C, {**OK, "logprobs": 21}, _bad("logprobs", "logprobs 21 is outside 0..20")),
    ("logit_bias", C, {**OK, "logit_bias": {"1": 5}},
     _bad("logit_bias", 'logit_bias {"1": 5} is not supported: this server has no logit bias')),
    ("no messages", CC, {"max_tokens": 2}, _bad("messages", "messages is missing")),
    ("message not object", CC, {"messages": ["hi"]},
     _bad("messages[0]", "messages[0] must be an object, not a string")),
    ("message unknown field", CC, {"messages": [{"role": "user", "content": "x", "name": "a"}]},
     _bad("messages[0].name", "unknown field 'messages[0].name'")),
    ("image part", CC, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     _bad("messages[0].content[0].type",
          "messages[0].content[0].type must be 'text': this server reads text only")),
    ("top_logprobs alone", CC, {"messages": MSGS, "top_logprobs": 2},
     _bad("top_logprobs", "top_logprobs needs logprobs: true")),
    ("two max tokens", CC, {"messages": MSGS, "max_tokens": 2, "max_completion_tokens": 3},
     _bad("max_completion_tokens", "max_tokens 2 and max_completion_tokens 3 differ: set one")),
    ("prompt on chat", CC, {"messages": MSGS, "prompt": "x"},
     _bad("prompt", "unknown field 'prompt'")),
    ("truncate_prompt on chat", CC, {"messages": MSGS, "truncate_prompt": True},
     _bad("truncate_prompt", "unknown field 'truncate_prompt'")),
    ("chat id_slot", CC, {"messages": MSGS, "id_slot": 1},
     _bad(None, "id_slot 1 is out of range: -1 (any) or 0..0")),  # type: ignore[arg-type]
    ("chat session and slot", CC, {"messages": MSGS, "id_slot": 0, "session": "s"},
     _bad(None, "a request with a session cannot set id_slot: the session picks its slot "  # type: ignore[arg-type]
                "and continues its own tokens")),
]


@pytest.mark.parametrize("path,body,expected", [c[1:] for c in FIELD_ERRORS],
                         ids=[c[0] for c in FIELD_ERRORS])
def test_field_errors(server: Server, path: str, body: object, expected: object) -> None:
    assert post(server, path, body) == expected


# requests whose values the shared layer refuses: the gRPC request's status details
SHARED = [
    ("temperature", {"temperature": 150}, dict(temperature=150.0)),
    ("top_p", {"top_p": 0}, dict(top_p=0.0)),
    ("context", {"max_tokens": 600}, dict(max_tokens=600)),
    ("id_slot", {"id_slot": 3}, dict(id_slot=3)),
    ("token id", {"prompt": [1, 99999]}, dict(prompt=[1, 99999])),
    ("session with slot", {"session": "s1", "id_slot": 0}, dict(session="s1", id_slot=0)),
    ("session name", {"session": "../x"}, dict(session="../x")),
    ("n_max", {"speculative": {"n_max": 99}}, dict(n_max=99)),
    ("stop bytes", {"stop": ["x" * 300]}, dict(stop=["x" * 300])),
]


@pytest.mark.parametrize("body,grpc_kw", [c[1:] for c in SHARED], ids=[c[0] for c in SHARED])
def test_same_errors_as_grpc(server: Server, body: dict[str, object],
                             grpc_kw: dict[str, object]) -> None:
    prompt = grpc_kw.pop("prompt", OK["prompt"])
    with grpc_client(server) as c, pytest.raises(grpc.RpcError) as err:
        list(c.generate_stream(make_request(prompt, max_tokens=grpc_kw.pop("max_tokens", 2),
                                            **grpc_kw)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, answer = post(server, C, {**OK, **body})
    assert (status, answer["error"]["message"], answer["error"]["code"]) == (
        400, err.value.details(), "invalid_argument")


def test_oversized_bodies(server: Server) -> None:
    """Over 6 x --max-prompt-bytes + 64 KiB: refused from Content-Length before the body
    is read, or once the body read so far passes it; a prompt within the body limit but
    over --max-prompt-bytes: the tokenizer's own refusal."""
    limit = 6 * 1000 + (64 << 10)
    message = (f"the request body is over {limit} bytes, the limit (6 x --max-prompt-bytes "
               f"1000 + {64 << 10})")
    big = '{"prompt": "' + "x" * limit + '"}'
    assert post(server, C, big) == error(400, message, "invalid_argument")
    # chunked: no length announced
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                  b"Content-Type: application/json\r\n\r\n")
        chunk = b"x" * 8192
        for _ in range(limit // len(chunk) + 2):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        answer = b""
        while message.encode() not in answer and len(answer) < 4096:
            part = s.recv(4096)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert message.encode() in answer
    assert post(server, C, {"prompt": "y" * 1001}) == error(
        400, "the text is 1001 bytes, the limit is 1000 (--max-prompt-bytes)",
        "invalid_argument")
    assert post(server, C, OK)[0] == 200


def test_model_not_found(server: Server) -> None:
    oa = client(server)
    with pytest.raises(openai.NotFoundError) as err:
        oa.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert err.value.status_code == 404
    assert err.value.body == {
        "message": f"model 'gpt-4' is not served here; this server serves {MODEL_ID!r} "
                   "(GET /v1/models)", "type": "not_found_error", "param": None,
        "code": "not_found"}


def test_unknown_path_and_method(server: Server) -> None:
    status, _, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and b'"not_found_error"' in body
    status, _, body = raw(server, "GET", C)
    assert status == 405 and b"GET /v1/completions: Method Not Allowed" in body


def test_queue_full_is_429(server: Server) -> None:
    """One slot and a queue of one: with a generation running and one waiting, the next
    request is refused at once, 429 with the engine's message (RESOURCE_EXHAUSTED)."""
    import threading

    rt = server.servicer.runtime
    assert rt is not None
    oa = client(server)
    long = oa.completions.create(model=MODEL_ID, prompt="def f(x):", max_tokens=480,
                                 temperature=0, stream=True)
    next(iter(long))
    waiting: list[tuple[int, object]] = []
    second = threading.Thread(target=lambda: waiting.append(post(server, C, OK)))
    second.start()
    try:
        t0 = time.monotonic()
        while not rt.engine.sched.waiting and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        assert len(rt.engine.sched.waiting) == 1 and rt.engine.n_running() == 1
        assert post(server, C, OK) == error(
            429, "1 requests are already waiting for a slot: try again later",
            "resource_exhausted")
    finally:
        long.close()
        second.join(timeout=30)
    assert waiting[0][0] == 200  # it got the slot once the first went away


def test_no_template_is_409(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = tmp_path_factory.mktemp("http-no-template")
    with running(http_config(d, chat_template=None, slots=1)) as srv:
        assert post(srv, CC, {"messages": MSGS}) == error(
            409, "the model has no chat template (tokenizer.chat_template); start the server "
                 "with --chat-template FILE", "failed_precondition")


def test_stalled_body_is_refused(server: Server) -> None:
    """A body that stops arriving: 400 once the door's body time is up, and the
    connection is free again (the server keeps serving)."""
    door = server._http
    assert door is not None
    door.body_timeout = 0.3
    try:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                      b"Content-Type: application/json\r\n\r\n{\"prompt\": ")
            t0 = time.monotonic()
            answer = b""
            while b"}}" not in answer and (part := s.recv(4096)):
                answer += part
            assert time.monotonic() - t0 < 5
    finally:
        door.body_timeout = 30.0
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"the request body did not arrive in full within 0.3 s" in answer
    assert post(server, C, OK)[0] == 200


def test_status_of_every_code() -> None:
    """Each exception's gRPC code and its HTTP status and OpenAI error type (the one table
    beside the gRPC mapping)."""
    from inference_svc import errors
    from inference_svc.api import openai_api
    from inference_svc.storage import slotfile

    cases = [(errors.InvalidArgument("m"), 400, "invalid_request_error"),
             (errors.Unauthenticated("m"), 401, "authentication_error"),
             (errors.PermissionDenied("m"), 403, "permission_error"),
             (errors.NotFound("m"), 404, "not_found_error"),
             (errors.FailedPrecondition("m"), 409, "conflict_error"),
             (errors.ResourceExhausted("m"), 429, "rate_limit_error"),
             (errors.DataLoss("m"), 500, "server_error"),
             (errors.Internal("m"), 500, "server_error"),
             (RuntimeError("m"), 500, "server_error"),
             (errors.Unavailable("m"), 503, "unavailable_error"),
             (errors.DeadlineExceeded("m"), 504, "timeout_error"),
             (TimeoutError("m"), 504, "timeout_error"),
             (slotfile.CorruptSlotFile("m"), 500, "server_error")]
    for exc, status, kind in cases:
        code, message = errors.status_of(exc)
        got_status, body = openai_api.error_body(code, message)
        assert (got_status, body["error"]["type"], body["error"]["code"]) == (
            status, kind, code.name.lower()), exc


def test_silent_connection_is_closed(server: Server) -> None:
    """A connection that sends no request is closed once the door's head time is up (it
    would hold one of the door's connections for ever)."""
    door = server._http
    assert door is not None
    door.head_timeout = 0.3
    try:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as s:
            t0 = time.monotonic()
            assert s.recv(1) == b""  # closed by the server
            assert 0.2 < time.monotonic() - t0 < 5
    finally:
        door.head_timeout = 30.0
    assert post(server, C, OK)[0] == 200
