"""A small client of the inference service, as a library and a command line.

    python -m inference_svc.client generate "def fibonacci(n):" --max-tokens 64
    python -m inference_svc.client chat --session alice --system "Be brief."
    echo "What did I ask you?" | python -m inference_svc.client chat --session alice
    python -m inference_svc.client save 0 session-a
    python -m inference_svc.client erase 0
    python -m inference_svc.client restore 1 session-a
    python -m inference_svc.client slots
    python -m inference_svc.client info
    python -m inference_svc.client generate "Hello" --session chat-1
    python -m inference_svc.client sessions
    python -m inference_svc.client delete-session chat-1

`--addr` (or WARMSLOT_ADDR) selects the server, default 127.0.0.1:50051.
Every call has a deadline (`--timeout` seconds).

`--http URL` (or WARMSLOT_HTTP_URL, e.g. http://127.0.0.1:8080) sends `generate` and
`chat` through the server's OpenAI-compatible HTTP door instead (the same options, key
and TLS files), and `models` lists its model:

    python -m inference_svc.client --http http://127.0.0.1:8080 generate "def f(x):"
    python -m inference_svc.client --http http://127.0.0.1:8080 models
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from inference_svc.pb import inference_pb2 as pb
from inference_svc.pb import inference_pb2_grpc as pb_grpc
from inference_svc.sessions.names import SESSION_HEADER, TURN_IDS_HEADER
from snapshot_svc.clientlib import auth, tls
from snapshot_svc.clientlib.auth import BearerInterceptor

DEFAULT_ADDR = "127.0.0.1:50051"


class InferenceClient:
    """Thin wrapper over the stub: every call has a deadline. `generate` and `chat` send
    a request again, up to `retries` times within the same deadline, when its stream
    was cut (a replica killed or stopping behind a router) and sending it again cannot
    add a turn twice (`resendable`)."""

    def __init__(self, addr: str = DEFAULT_ADDR, timeout: float = 60.0, *,
                 api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 retries: int = 2) -> None:
        self.addr = addr
        self.timeout = timeout
        self.retries = retries
        channel = (grpc.insecure_channel(addr) if credentials is None
                   else grpc.secure_channel(addr, credentials))
        self.channel = (grpc.intercept_channel(channel, BearerInterceptor(api_key))
                        if api_key else channel)
        self.stub = pb_grpc.InferenceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate_stream(self, request: pb.GenerateRequest,
                        timeout: float | None = None) -> Any:
        """The response stream (iterate it; .cancel() stops the generation)."""
        return self.stub.Generate(request, timeout=timeout or self.timeout,
                                  metadata=session_metadata(request))

    def generate(self, prompt: str | list[int], timeout: float | None = None,
                 **fields: Any) -> tuple[list[pb.GenerateResponse], pb.GenerateResponse]:
        """Runs a whole generation: (all responses, the last one)."""
        responses = self._whole(self.generate_stream, make_request(prompt, **fields), timeout)
        return responses, responses[-1]

    def chat_stream(self, request: pb.ChatRequest, timeout: float | None = None) -> Any:
        """The response stream of a Chat (iterate it; .cancel() stops the generation)."""
        return self.stub.Chat(request, timeout=timeout or self.timeout,
                              metadata=session_metadata(request))

    def chat(self, messages: list[tuple[str, str]], timeout: float | None = None,
             **fields: Any) -> tuple[list[pb.GenerateResponse], pb.GenerateResponse]:
        """Runs a whole Chat turn: (all responses, the last one)."""
        responses = self._whole(self.chat_stream, make_chat_request(messages, **fields),
                                timeout)
        return responses, responses[-1]

    def _whole(self, call: Any, request: pb.GenerateRequest | pb.ChatRequest,
               timeout: float | None) -> list[pb.GenerateResponse]:
        """All responses of one request, sent again while its stream was cut, it is
        resendable and attempts and deadline remain. A turn continuing a session gets
        an id (turn_id) unless it has one, so that sent again it replaces itself."""
        if continues_session(request) and not request.turn_id:
            request.turn_id = uuid.uuid4().hex
        deadline = time.monotonic() + (timeout or self.timeout)
        attempts = 0
        while True:
            attempts += 1
            stream = call(request, max(deadline - time.monotonic(), 0.001))
            try:
                return list(stream)
            except grpc.RpcError as err:
                if (attempts > self.retries or not stream_cut(err)
                        or not resendable(request, keeps_turn_ids(stream))
                        or time.monotonic() >= deadline):
                    raise

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=self.timeout).tokens)

    def detokenize(self, tokens: list[int]) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(tokens=tokens),
                                    timeout=self.timeout).text

    def info(self) -> pb.GetInfoResponse:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=self.timeout)

    def slots(self) -> list[pb.SlotInfo]:
        return list(self.stub.ListSlots(pb.ListSlotsRequest(), timeout=self.timeout).slots)

    def save(self, id_slot: int, filename: str) -> pb.SaveSlotResponse:
        return self.stub.SaveSlot(pb.SaveSlotRequest(id_slot=id_slot, filename=filename),
                                  timeout=self.timeout)

    def restore(self, id_slot: int, filename: str) -> pb.RestoreSlotResponse:
        return self.stub.RestoreSlot(pb.RestoreSlotRequest(id_slot=id_slot, filename=filename),
                                     timeout=self.timeout)

    def erase(self, id_slot: int) -> pb.EraseSlotResponse:
        return self.stub.EraseSlot(pb.EraseSlotRequest(id_slot=id_slot), timeout=self.timeout)

    def sessions(self) -> list[pb.SessionInfo]:
        return list(self.stub.ListSessions(pb.ListSessionsRequest(),
                                           timeout=self.timeout).sessions)

    def delete_session(self, name: str, owner: str = "") -> pb.DeleteSessionResponse:
        return self.stub.DeleteSession(pb.DeleteSessionRequest(name=name, owner=owner),
                                       timeout=self.timeout)


def stream_cut(err: grpc.RpcError) -> bool:
    """A stream ended by the way, not by the server's answer: UNAVAILABLE (no replica
    took it, or one stopping), or UNKNOWN "Stream removed" (a router reset the stream
    of a replica that died under it)."""
    code = err.code()
    return code == grpc.StatusCode.UNAVAILABLE or (
        code == grpc.StatusCode.UNKNOWN and "Stream removed" in (err.details() or ""))


def continues_session(request: pb.GenerateRequest | pb.ChatRequest) -> bool:
    """A Generate continuing a session or a Chat appended to it: a turn the session
    adds to what it holds."""
    return request.HasField("session") and (isinstance(request, pb.GenerateRequest)
                                            or request.append)


def keeps_turn_ids(stream: Any) -> bool:
    """Whether the server of a (finished) stream said it keeps turn ids."""
    try:
        metadata = stream.initial_metadata() or ()
    except grpc.RpcError:
        return False
    return any(k == TURN_IDS_HEADER and v == "1" for k, v in metadata)


def resendable(request: pb.GenerateRequest | pb.ChatRequest, turn_ids: bool = False) -> bool:
    """Whether a request cut mid-stream can be sent again: one without a session keeps
    nothing, and a Chat whose messages are the whole conversation replaces what the
    session holds. A Generate continuing a session, or a Chat appended to it, may have
    run to its end before the cut and been kept: it is sent again only with its
    turn_id to a server that keeps turn ids (`turn_ids`: its stream's initial metadata
    said so), where it replaces the turn it repeats; otherwise its caller gets the
    error, as sent again it would be kept twice."""
    if not continues_session(request):
        return True
    return bool(request.turn_id) and turn_ids


def session_metadata(request: pb.GenerateRequest | pb.ChatRequest) -> tuple[tuple[str, str], ...]:
    """The request's session as `x-session-id` metadata (none without a session): a
    router in front of replicas (deploy/, `--profile replicas`) sends every turn of a
    session to the replica that holds it. The server reads the session from the
    request itself."""
    return ((SESSION_HEADER, request.session),) if request.HasField("session") else ()


def make_request(prompt: str | list[int], *, id_slot: int | None = None,
                 cache_prompt: bool | None = None, truncate_prompt: bool = False,
                 **options: Any) -> pb.GenerateRequest:
    """A GenerateRequest; None leaves a field unset (the server's default). options:
    those of `set_options`."""
    req = pb.GenerateRequest(truncate_prompt=truncate_prompt)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_tokens.extend(prompt)
    for name, value in (("id_slot", id_slot), ("cache_prompt", cache_prompt)):
        if value is not None:
            setattr(req, name, value)
    return set_options(req, **options)


def make_chat_request(messages: list[tuple[str, str]], *,
                      add_generation_prompt: bool | None = None, append: bool = False,
                      id_slot: int | None = None, cache_prompt: bool | None = None,
                      **options: Any) -> pb.ChatRequest:
    """A ChatRequest of (role, content) messages; `append`: they continue the
    conversation the session keeps; None leaves a field unset; options: those of
    `set_options`."""
    req = pb.ChatRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                         append=append)
    for name, value in (("add_generation_prompt", add_generation_prompt), ("id_slot", id_slot),
                        ("cache_prompt", cache_prompt)):
        if value is not None:
            setattr(req, name, value)
    return set_options(req, **options)


R = TypeVar("R", pb.GenerateRequest, pb.ChatRequest)


def set_options(req: R, *, max_tokens: int | None = None, session: str | None = None,
                logprobs: int = 0, stop: list[str] | None = None,
                temperature: float | None = None, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None,
                seed: int | None = None, repeat_penalty: float | None = None,
                repeat_last_n: int | None = None, presence_penalty: float | None = None,
                frequency_penalty: float | None = None, speculative: bool | None = None,
                n_max: int | None = None, n_min: int | None = None,
                p_min: float | None = None, lookup: bool | None = None,
                turn_id: str | None = None) -> R:
    """Sets the options Generate and Chat share; None leaves a field unset."""
    req.stop.extend(stop or [])
    req.logprobs = logprobs
    for name, value in (("max_tokens", max_tokens), ("session", session),
                        ("turn_id", turn_id)):
        if value is not None:
            setattr(req, name, value)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("min_p", min_p), ("seed", seed), ("repeat_penalty", repeat_penalty),
                        ("repeat_last_n", repeat_last_n),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None:
            setattr(req.sampling, name, value)
    for name, value in (("enabled", speculative), ("n_max", n_max), ("n_min", n_min),
                        ("p_min", p_min), ("lookup", lookup)):
        if value is not None:
            setattr(req.speculative, name, value)
    return req


def http_body(options: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-API body fields of the options of `set_options` (None: unset; the
    server's defaults apply as over gRPC); logprobs are not shown in HTTP mode."""
    body = {k: v for k, v in options.items()
            if v is not None and k not in ("speculative", "n_max", "n_min", "p_min",
                                           "logprobs", "turn_id")}
    spec = {k: v for k, v in (("enabled", options.get("speculative")),
                              ("n_max", options.get("n_max")), ("n_min", options.get("n_min")),
                              ("p_min", options.get("p_min"))) if v is not None}
    if spec:
        body["speculative"] = spec
    return body


def http_stream(url: str, path: str, body: dict[str, Any], *, key: str | None = None,
                context: ssl.SSLContext | None = None,
                timeout: float = 300.0) -> Iterator[dict[str, Any]]:
    """The chunks of a streamed request to the HTTP door (`path` under /v1). Raises
    RuntimeError with the server's error message."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if isinstance(body.get("session"), str):
        headers[SESSION_HEADER] = body["session"]  # for a router, as over gRPC
    req = urllib.request.Request(url.rstrip("/") + "/v1" + path,
                                 json.dumps({**body, "stream": True}).encode(), headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout, context=context)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {_http_message(exc.read())}") from None
    with resp:
        for line in resp:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            yield chunk


def _http_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")


def _show(msg: Any) -> None:
    print(json.dumps(json_format.MessageToDict(msg, always_print_fields_with_no_presence=True),
                     indent=2))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inference_svc.client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default=os.environ.get("WARMSLOT_ADDR", DEFAULT_ADDR))
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each call (s)")
    p.add_argument("--api-key-file", default=os.environ.get("WARMSLOT_API_KEY_FILE"),
                   help="file holding the API key to send (env WARMSLOT_API_KEY_FILE)")
    p.add_argument("--http", default=os.environ.get("WARMSLOT_HTTP_URL"),
                   help="URL of the server's HTTP door (http[s]://HOST:PORT): generate and "
                        "chat go through it (env WARMSLOT_HTTP_URL)")
    # CLIENT variables: WARMSLOT_TLS_CERT / _KEY are the service's own certificate
    for name, what in (("ca", "CA (PEM) of the server's certificate: connect with TLS"),
                       ("cert", "client certificate (PEM), for a server that requires one"),
                       ("key", "key (PEM) of --tls-cert")):
        var = f"WARMSLOT_CLIENT_TLS_{name.upper()}"
        p.add_argument(f"--tls-{name}", default=os.environ.get(var), help=f"{what} (env {var})")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a completion")
    g.add_argument("prompt")
    g.add_argument("--slot", type=int, help="slot id (default: any)")
    _option_flags(g)
    g.add_argument("--no-cache", action="store_true", help="do not reuse the slot's prefix")
    g.add_argument("--truncate", action="store_true", help="drop old prompt tokens to fit")
    g.add_argument("--json", action="store_true", help="print the last response as JSON")
    ch = sub.add_parser("chat", help="talk with the model: one line of stdin is one turn")
    ch.add_argument("--system", help="system message first in the conversation (with "
                                     "--session: appended with this invocation's first line)")
    _option_flags(ch)
    for name, hlp in (("save", "save a slot"), ("restore", "restore a slot")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("slot", type=int)
        s.add_argument("filename")
    e = sub.add_parser("erase", help="erase a slot")
    e.add_argument("slot", type=int)
    t = sub.add_parser("tokenize", help="text to token ids")
    t.add_argument("text")
    sub.add_parser("slots", help="list the slots")
    sub.add_parser("sessions", help="list the sessions (a user key: its own)")
    ds = sub.add_parser("delete-session", help="delete a session from every tier")
    ds.add_argument("name")
    ds.add_argument("--owner", default="", help="admin key: the owner of a user key's session")
    sub.add_parser("info", help="models, slots, formats")
    sub.add_parser("models", help="the HTTP door's model list (needs --http)")
    return p


def _option_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the options Generate and Chat share (set_options)."""
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--session", help="session name: the conversation's state stays on the "
                                     "server between requests")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--repeat-last-n", type=int)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    p.add_argument("--n-max", type=int, help="tokens drafted per step")
    p.add_argument("--no-lookup", action="store_true",
                   help="no lookup drafter (draft model only, if the server has one)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=0,
                   help="logprobs of each token and this many alternatives (0..20; --json "
                        "shows those of the last response)")


def _options(a: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=a.max_tokens, session=a.session, temperature=a.temperature,
                top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                speculative=False if a.no_spec else None, n_max=a.n_max,
                lookup=False if a.no_lookup else None, stop=a.stop,
                logprobs=a.logprobs)


def chat_loop(c: InferenceClient, a: argparse.Namespace, lines: Iterator[str],
              out: Any) -> list[tuple[str, str]]:
    """One turn per input line; the reply is streamed to `out`. Without --session the
    whole conversation goes with every turn. With --session the server keeps the
    conversation (and its state): each turn sends only its new messages, appended to
    it, so a later invocation with the same session continues it. Returns this
    invocation's messages and replies."""
    messages: list[tuple[str, str]] = [("system", a.system)] if a.system else []
    unsent = list(messages)  # with --session: what the server does not keep yet
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append(("user", text))
        unsent.append(("user", text))
        req = (make_chat_request(unsent, append=True, **_options(a)) if a.session
               else make_chat_request(messages, **_options(a)))
        reply: list[str] = []
        for r in c.chat_stream(req):
            reply.append(r.text)
            out.write(r.text)
            out.flush()
        out.write("\n")
        messages.append(("assistant", "".join(reply)))
        unsent = []
    return messages


def _print_timings(t: dict[str, Any], reason: str) -> None:
    tier = t.get("session_tier")
    where = f"slot {t['id_slot']}" + (f", session from {tier}" if tier else "")
    print(f"\n\n[{where}] {reason}: "
          f"prompt {t['prompt_n']} processed + {t['cache_n']} cached in {t['prompt_ms']:.1f} ms; "
          f"{t['predicted_n']} generated in {t['predicted_ms']:.1f} ms "
          f"({t['predicted_per_second']:.1f} tokens/s); draft {t['draft_n_accepted']}/"
          f"{t['draft_n']} accepted ({t['lookup_n_accepted']}/{t['lookup_n']} by lookup), "
          f"draft prefill {t['draft_prompt_n']}", file=sys.stderr)


def _http_generate(a: argparse.Namespace, key: str | None,
                   ctx: ssl.SSLContext | None) -> None:
    """`generate` through the HTTP door: /v1/completions, streamed."""
    body = {"prompt": a.prompt, **http_body(_options(a))}
    for name, value in (("id_slot", a.slot), ("cache_prompt", False if a.no_cache else None),
                        ("truncate_prompt", a.truncate or None)):
        if value is not None:
            body[name] = value
    last: dict[str, Any] = {}
    if not a.json:
        sys.stdout.write(a.prompt)
    for chunk in http_stream(a.http, "/completions", body, key=key, context=ctx,
                             timeout=a.timeout):
        if chunk["choices"] and not a.json:
            sys.stdout.write(chunk["choices"][0]["text"])
            sys.stdout.flush()
        if "timings" in chunk:
            last = chunk
    if a.json:
        print(json.dumps(last, indent=2))
    elif last:
        _print_timings(last["timings"], last["choices"][0]["finish_reason"])


def http_chat_loop(a: argparse.Namespace, lines: Iterator[str], out: Any, key: str | None,
                   ctx: ssl.SSLContext | None) -> list[tuple[str, str]]:
    """chat_loop through the HTTP door (/v1/chat/completions)."""
    messages: list[tuple[str, str]] = [("system", a.system)] if a.system else []
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append(("user", text))
        body = {"messages": [{"role": r, "content": c} for r, c in messages],
                **http_body(_options(a))}
        reply: list[str] = []
        for chunk in http_stream(a.http, "/chat/completions", body, key=key, context=ctx,
                                 timeout=a.timeout):
            piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if piece:
                reply.append(piece)
                out.write(piece)
                out.flush()
        out.write("\n")
        messages.append(("assistant", "".join(reply)))
    return messages


def _http_context(a: argparse.Namespace) -> ssl.SSLContext | None:
    if not a.tls_ca:
        return None
    ctx = ssl.create_default_context(cafile=a.tls_ca)
    if a.tls_cert:
        ctx.load_cert_chain(a.tls_cert, a.tls_key)
    return ctx


def _http_main(a: argparse.Namespace, key: str | None) -> int:
    ctx = _http_context(a)
    try:
        if a.cmd == "generate":
            _http_generate(a, key, ctx)
        elif a.cmd == "chat":
            http_chat_loop(a, iter(sys.stdin), sys.stdout, key, ctx)
        elif a.cmd == "models":
            req = urllib.request.Request(a.http.rstrip("/") + "/v1/models", headers=(
                {"Authorization": f"Bearer {key}"} if key else {}))
            try:
                with urllib.request.urlopen(req, timeout=a.timeout, context=ctx) as resp:
                    print(json.dumps(json.loads(resp.read()), indent=2))
            except urllib.error.HTTPError as exc:
                raise RuntimeError(f"HTTP {exc.code}: {_http_message(exc.read())}") from None
        else:
            print(f"error: {a.cmd} is a gRPC call: leave out --http", file=sys.stderr)
            return 2
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _generate(c: InferenceClient, a: argparse.Namespace) -> None:
    req = make_request(a.prompt, id_slot=a.slot, cache_prompt=False if a.no_cache else None,
                       truncate_prompt=a.truncate, **_options(a))
    last = None
    stream: Iterator[pb.GenerateResponse] = c.generate_stream(req)
    if not a.json:
        sys.stdout.write(a.prompt)
    for r in stream:
        if not a.json:
            sys.stdout.write(r.text)
            sys.stdout.flush()
        last = r
    if last is None:
        return
    if a.json:
        _show(last)
        return
    t = json_format.MessageToDict(last.timings, preserving_proto_field_name=True,
                                  always_print_fields_with_no_presence=True)
    t["session_tier"] = (pb.SessionTier.Name(last.timings.session_tier)
                         .removeprefix("SESSION_TIER_").lower()
                         if last.timings.session_tier else None)
    _print_timings(t, pb.StopReason.Name(last.stop_reason).removeprefix("STOP_REASON_").lower())


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    key = auth.read_key_file(Path(a.api_key_file)) if a.api_key_file else None
    if (a.tls_cert or a.tls_key) and not a.tls_ca:
        print("error: --tls-cert and --tls-key need --tls-ca", file=sys.stderr)
        return 2
    if a.http:
        return _http_main(a, key)
    if a.cmd == "models":
        print("error: models lists the HTTP door's model: give --http URL", file=sys.stderr)
        return 2
    creds = (tls.channel_credentials(Path(a.tls_ca), a.tls_cert and Path(a.tls_cert),
                                     a.tls_key and Path(a.tls_key)) if a.tls_ca else None)
    with InferenceClient(a.addr, a.timeout, api_key=key, credentials=creds) as c:
        try:
            if a.cmd == "generate":
                _generate(c, a)
            elif a.cmd == "chat":
                chat_loop(c, a, iter(sys.stdin), sys.stdout)
            elif a.cmd == "save":
                _show(c.save(a.slot, a.filename))
            elif a.cmd == "restore":
                _show(c.restore(a.slot, a.filename))
            elif a.cmd == "erase":
                _show(c.erase(a.slot))
            elif a.cmd == "tokenize":
                print(c.tokenize(a.text))
            elif a.cmd == "slots":
                for s in c.slots():
                    print(json.dumps(json_format.MessageToDict(
                        s, always_print_fields_with_no_presence=True)))
            elif a.cmd == "sessions":
                for s in c.sessions():
                    print(json.dumps(json_format.MessageToDict(
                        s, always_print_fields_with_no_presence=True)))
            elif a.cmd == "delete-session":
                _show(c.delete_session(a.name, a.owner))
            elif a.cmd == "info":
                _show(c.info())
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
