"""The OpenAI API's JSON and the service's own messages, both ways.

A request body becomes the GenerateRequest (`/v1/completions`) or ChatRequest
(`/v1/chat/completions`) a gRPC client would send for it: this module checks only what
JSON itself can get wrong (a field's type, a field OpenAI has and this server has not,
an unknown field); every check of a value, and every default, is the gRPC path's own
(`GenerateParams.from_pb` / `from_chat`). The responses of the generation, the gRPC
path's GenerateResponse messages, become OpenAI's objects and chunks.

Fields beyond OpenAI's, in the body as vLLM takes `extra_body`: `top_k`, `min_p`,
`repeat_penalty`, `repeat_last_n`, `session`, `id_slot`, `cache_prompt`, `speculative` (an
object: `enabled`, `n_max`, `n_min`, `p_min`, `lookup`), and on `/v1/completions` `truncate_prompt`;
on `/v1/chat/completions` `add_generation_prompt`. A response adds
llama.cpp's `timings`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from inference_svc.core import Tokenizer
from inference_svc.errors import InvalidArgument
from inference_svc.pb import inference_pb2 as pb

JSON = dict[str, Any]
INT32 = (-(1 << 31), (1 << 31) - 1)
UINT64 = (0, (1 << 64) - 1)
# the HTTP statuses of the gRPC codes (the exceptions' codes: inference_svc.errors.status_of)
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's (and llama.cpp's) error types by HTTP status
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
              403: "permission_error", 404: "not_found_error", 409: "conflict_error",
              429: "rate_limit_error", 501: "not_supported_error", 503: "unavailable_error",
              504: "timeout_error"}
FINISH_REASON = {pb.STOP_REASON_EOS: "stop", pb.STOP_REASON_STOP_STRING: "stop",
                 pb.STOP_REASON_MAX_TOKENS: "length"}
TIER_NAME = {v.number: v.name.removeprefix("SESSION_TIER_").lower()
             for v in pb.SessionTier.DESCRIPTOR.values if v.number}


class BadField(InvalidArgument):
    """A request field JSON got wrong; `param` names it (the error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_body(code: grpc.StatusCode, message: str, param: str | None = None
               ) -> tuple[int, JSON]:
    """The HTTP status and OpenAI's error object of a failed call's status code."""
    status = HTTP_STATUS.get(code, 500)
    return status, {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"),
                              "param": param, "code": code.name.lower()}}


# ------------------------------------------------------------------------ the body


def _no_duplicates(pairs: list[tuple[str, Any]]) -> JSON:
    out: JSON = {}
    for k, v in pairs:
        if k in out:
            raise BadField(k, f"the field {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> JSON:
    """The body's JSON object; InvalidArgument when it is not one."""
    if not raw.strip():
        raise InvalidArgument("the request body is empty: a JSON object is needed")
    try:
        data = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except BadField:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {_kind(data)}")
    return data


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


class _Fields:
    """Typed reads of a JSON object's fields; null is the same as absent."""

    def __init__(self, data: JSON, allowed: frozenset[str], where: str = "") -> None:
        self.data, self.where = data, where
        for k in data:
            if k not in allowed:
                raise BadField(self.path(k), f"unknown field {self.path(k)!r}")

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def _get(self, name: str, ok: Callable[[Any], bool], what: str) -> Any:
        v = self.data.get(name)
        if v is not None and not ok(v):
            raise BadField(self.path(name),
                           f"{self.path(name)} must be {what}, not {_kind(v)}")
        return v

    def int(self, name: str, bounds: tuple[int, int] = INT32) -> int | None:
        v = self._get(name, lambda x: type(x) is int, "an integer")
        if v is not None and not bounds[0] <= v <= bounds[1]:
            raise BadField(self.path(name), f"{self.path(name)} {v} is outside "
                                            f"{bounds[0]}..{bounds[1]}")
        return v

    def number(self, name: str) -> float | None:
        v = self._get(name, lambda x: type(x) in (int, float), "a number")
        return None if v is None else float(v)

    def bool(self, name: str) -> bool | None:
        return self._get(name, lambda x: type(x) is bool, "a boolean")

    def str(self, name: str) -> str | None:
        return self._get(name, lambda x: type(x) is str, "a string")

    def list(self, name: str) -> list[Any] | None:
        return self._get(name, lambda x: type(x) is list, "an array")

    def obj(self, name: str, allowed: frozenset[str]) -> _Fields | None:
        v = self._get(name, lambda x: type(x) is dict, "an object")
        return None if v is None else _Fields(v, allowed, self.path(name))

    def only(self, name: str, neutral: Callable[[Any], bool], why: str) -> None:
        """A field OpenAI has and this server supports only at its neutral value."""
        v = self.data.get(name)
        if v is not None and not neutral(v):
            raise BadField(self.path(name), f"{self.path(name)} {json.dumps(v)[:64]} is not "
                                            f"supported: {why}")


SAMPLING = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
            "frequency_penalty")
SPECULATIVE = frozenset(("enabled", "n_max", "n_min", "p_min", "lookup"))
COMMON = frozenset(("model", "stream", "stream_options", "max_tokens", "stop", "n", "seed",
                    "user", "logit_bias", "top_k", "repeat_last_n", "session", "speculative",
                    "id_slot", "cache_prompt", "turn_id",
                    *SAMPLING))
COMPLETION = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "truncate_prompt"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                 "add_generation_prompt"}
MESSAGE = frozenset(("role", "content"))
PART = frozenset(("type", "text"))


@dataclass
class Request:
    """A request of the HTTP door: its gRPC message and how to answer it."""

    message: pb.GenerateRequest | pb.ChatRequest
    chat: bool
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the response
    model: str | None = None  # the model the client named
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


def _options(f: _Fields, req: pb.GenerateRequest | pb.ChatRequest, session: str | None,
             max_tokens: int | None) -> None:
    """The fields /v1/completions and /v1/chat/completions share, into req."""
    f.only("n", lambda v: v == 1, "one choice per request (n must be 1)")
    f.only("logit_bias", lambda v: v == {}, "this server has no logit bias")
    f.str("user")  # OpenAI's end-user id: checked, not used
    if max_tokens is not None:
        req.max_tokens = max_tokens
    s = req.sampling
    for name in SAMPLING:
        v = f.number(name)
        if v is not None:
            setattr(s, name, v)
    for name in ("top_k", "repeat_last_n"):
        v = f.int(name)
        if v is not None:
            setattr(s, name, v)
    seed = f.int("seed", UINT64)
    if seed is not None:
        s.seed = seed
    stop = f.data.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif stop is not None:
        if type(stop) is not list or not all(type(x) is str for x in stop):
            raise BadField("stop", f"stop must be a string or an array of strings, not "
                                   f"{_kind(stop)}")
        req.stop.extend(stop)
    name = f.str("session")
    if name is not None and session is not None and name != session:
        raise BadField("session", f"the body's session {name!r} and the X-Session-Id header's "
                                  f"{session!r} differ")
    if (name or session) is not None:
        req.session = name if name is not None else session  # type: ignore[assignment]
    turn_id = f.str("turn_id")  # checked with the session (GenerateParams)
    if turn_id is not None:
        req.turn_id = turn_id
    id_slot = f.int("id_slot")
    if id_slot is not None:
        req.id_slot = id_slot
    cache = f.bool("cache_prompt")
    if cache is not None:
        req.cache_prompt = cache
    sp = f.obj("speculative", SPECULATIVE)
    if sp is not None:
        for k in ("enabled", "lookup"):
            b = sp.bool(k)
            if b is not None:
                setattr(req.speculative, k, b)
        for k in ("n_max", "n_min"):
            v = sp.int(k)
            if v is not None:
                setattr(req.speculative, k, v)
        p_min = sp.number("p_min")
        if p_min is not None:
            req.speculative.p_min = p_min


def _stream_options(f: _Fields, out: Request) -> None:
    out.stream = bool(f.bool("stream"))
    opts = f.obj("stream_options", frozenset(("include_usage",)))
    if opts is not None:
        if not out.stream:
            raise BadField("stream_options", "stream_options needs stream: true")
        out.include_usage = bool(opts.bool("include_usage"))
    out.model = f.str("model")


def completion_request(body: JSON, session: str | None = None) -> Request:
    """The GenerateRequest of a /v1/completions body (session: X-Session-Id)."""
    f = _Fields(body, COMPLETION)
    req = pb.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if not all(INT32[0] <= t <= INT32[1] for t in prompt):
            raise BadField("prompt", "prompt holds a token id outside the 32-bit integers")
        req.prompt_tokens.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadField("prompt", f"prompt holds {len(prompt)} prompts: this server takes one "
                                 "per request")
    else:
        raise BadField("prompt", "prompt must be a string or an array of token ids, not "
                                 f"{_kind(prompt)}")
    f.only("echo", lambda v: v is False, "the response never repeats the prompt")
    f.only("best_of", lambda v: v == 1, "one choice per request (best_of must be 1)")
    f.only("suffix", lambda v: False, "this server does not insert text")
    out = Request(req, chat=False)
    _stream_options(f, out)
    _options(f, req, session, f.int("max_tokens"))
    lp = f.int("logprobs", (0, 20))
    if lp is not None:  # the engine gives at least one alternative; trimmed to lp
        out.top_logprobs = lp
        req.logprobs = max(lp, 1)
    req.truncate_prompt = bool(f.bool("truncate_prompt"))
    return out


def _content(m: _Fields) -> str:
    v = m.data.get("content")
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # content parts: text ones only
        texts = []
        for i, part in enumerate(v):
            where = m.path(f"content[{i}]")
            if not isinstance(part, dict):
                raise BadField(where, f"{where} must be an object, not {_kind(part)}")
            p = _Fields(part, PART, where)
            if p.str("type") != "text":
                raise BadField(p.path("type"), f"{p.path('type')} must be 'text': this server "
                                               "reads text only")
            text = p.str("text")
            if text is None:
                raise BadField(p.path("text"), f"{p.path('text')} is missing")
            texts.append(text)
        return "".join(texts)
    raise BadField(m.path("content"), f"{m.path('content')} must be a string or an array of "
                                      f"text parts, not {_kind(v)}")


def chat_request(body: JSON, session: str | None = None) -> Request:
    """The ChatRequest of a /v1/chat/completions body (session: X-Session-Id)."""
    f = _Fields(body, CHAT)
    req = pb.ChatRequest()
    messages = f.list("messages")
    if messages is None:
        raise BadField("messages", "messages is missing")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadField(where, f"{where} must be an object, not {_kind(m)}")
        mf = _Fields(m, MESSAGE, where)
        role = mf.str("role")
        if role is None:
            raise BadField(mf.path("role"), f"{mf.path('role')} is missing")
        req.messages.append(pb.ChatMessage(role=role, content=_content(mf)))
    agp = f.bool("add_generation_prompt")
    if agp is not None:
        req.add_generation_prompt = agp
    out = Request(req, chat=True)
    _stream_options(f, out)
    mt, mct = f.int("max_tokens"), f.int("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise BadField("max_completion_tokens", f"max_tokens {mt} and max_completion_tokens "
                                                f"{mct} differ: set one")
    _options(f, req, session, mct if mct is not None else mt)
    top = f.int("top_logprobs", (0, 20))
    if f.bool("logprobs"):
        out.top_logprobs = top or 0
        req.logprobs = max(top or 0, 1)  # the engine gives at least one; trimmed to top
    elif top is not None:
        raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    return out


# ------------------------------------------------------------------------ responses


@dataclass(frozen=True)
class Served:
    """What a response names: the model's id and the system fingerprint."""

    model: str
    fingerprint: str


def usage(t: pb.Timings) -> JSON:
    prompt = t.prompt_n + t.cache_n
    return {"prompt_tokens": prompt, "completion_tokens": t.predicted_n,
            "total_tokens": prompt + t.predicted_n,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


def timings(t: pb.Timings) -> JSON:
    """llama.cpp's `timings` with the service's other counters; session_tier by name
    (null: no session)."""
    out: JSON = {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields}
    out["session_tier"] = TIER_NAME.get(t.session_tier)
    n = t.predicted_n
    out["prompt_per_token_ms"] = t.prompt_ms / t.prompt_n if t.prompt_n else 0.0
    out["predicted_per_token_ms"] = t.predicted_ms / n if n else 0.0
    return out


def _piece(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(token)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(lps: list[pb.TokenLogprob], n_top: int, tok: Tokenizer) -> JSON:
    content = []
    for lp in lps:
        text, raw = _piece(tok, lp.token)
        top = []
        for alt in lp.top[:n_top]:
            t, r = _piece(tok, alt.token)
            top.append({"token": t, "logprob": alt.logprob, "bytes": r})
        content.append({"token": text, "logprob": lp.logprob, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[pb.TokenLogprob], n_top: int, tok: Tokenizer,
                        offset: int) -> JSON:
    """OpenAI's legacy logprobs; offset: the characters of text before these tokens."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = _piece(tok, lp.token)[0]
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({_piece(tok, a.token)[0]: a.logprob for a in lp.top[:n_top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


class Renderer:
    """Turns one request's GenerateResponses into OpenAI's chunks or final object."""

    def __init__(self, req: Request, served: Served, tok: Tokenizer) -> None:
        self.req, self.served, self.tok = req, served, tok
        self.offset = 0  # characters of text sent so far (completions' text_offset)

    def _head(self, chunk: bool) -> JSON:
        r = self.req
        if r.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
            prefix = "chatcmpl-"
        else:
            kind, prefix = "text_completion", "cmpl-"
        return {"id": prefix + r.id, "object": kind, "created": r.created,
                "model": self.served.model, "system_fingerprint": self.served.fingerprint}

    def _logprobs(self, lps: list[pb.TokenLogprob]) -> JSON | None:
        n = self.req.top_logprobs
        if n is None:
            return None
        if self.req.chat:
            return chat_logprobs(lps, n, self.tok)
        return completion_logprobs(lps, n, self.tok, self.offset)

    def _chunk(self, choice: JSON, **extra: Any) -> JSON:
        out = self._head(True)
        out["choices"] = [choice]
        if self.req.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def first(self) -> JSON | None:
        """The chunk before any text: a chat's assistant role (None for completions)."""
        if not self.req.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunks(self, r: pb.GenerateResponse) -> list[JSON]:
        """The chunks of one response: its text (when any), then the end (when done),
        then the usage (when asked)."""
        out = []
        if r.text or r.logprobs:
            lps = self._logprobs(list(r.logprobs))
            if self.req.chat:
                choice: JSON = {"index": 0, "delta": {"content": r.text}, "logprobs": lps,
                                "finish_reason": None}
            else:
                choice = {"index": 0, "text": r.text, "logprobs": lps, "finish_reason": None}
            self.offset += len(r.text)
            out.append(self._chunk(choice))
        if r.done:
            reason = FINISH_REASON.get(r.stop_reason, "stop")
            choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
                      if self.req.chat else
                      {"index": 0, "text": "", "logprobs": None, "finish_reason": reason})
            out.append(self._chunk(choice, timings=timings(r.timings)))
            if self.req.include_usage:
                last = self._head(True)
                last["choices"] = []
                last["usage"] = usage(r.timings)
                out.append(last)
        return out

    def whole(self, rs: list[pb.GenerateResponse]) -> JSON:
        """The non-streamed answer of all the responses."""
        last = rs[-1]
        text = "".join(r.text for r in rs)
        lps = self._logprobs([lp for r in rs for lp in r.logprobs])
        reason = FINISH_REASON.get(last.stop_reason, "stop")
        out = self._head(False)
        if self.req.chat:
            out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                               "logprobs": lps, "finish_reason": reason}]
        else:
            out["choices"] = [{"index": 0, "text": text, "logprobs": lps,
                               "finish_reason": reason}]
        out["usage"] = usage(last.timings)
        out["timings"] = timings(last.timings)
        return out


def sse(obj: JSON | str) -> bytes:
    """One Server-Sent Event's bytes (`data: ...` and a blank line)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"
