"""The OpenAI-compatible HTTP door of the inference service: `POST /v1/chat/completions`,
`POST /v1/completions` (Server-Sent Events when streaming), `GET /v1/models`,
`GET /health`, served by uvicorn (HTTP/1.1, h11) with Starlette's routing on a thread
of its own, on the same engine, slots and sessions as gRPC.

A request goes through the gRPC path's own layer: its body becomes the GenerateRequest
or ChatRequest a gRPC client would send (inference_svc.api.openai_api), which
`InferenceServicer.generation` checks, completes with the defaults and queues, exactly
as for Generate and Chat; a failure is the same exception, whose gRPC code
(inference_svc.errors.status_of) gives the HTTP status and OpenAI's error object. Keys
are the --api-keys file's (`Authorization: Bearer <key>`, the same roles: a completion
is Generate, a chat completion Chat, the model list GetInfo); TLS is the service's
certificate (and client CA). A generation's blocking part (tokenizing, waiting for the
engine's output) runs on a pool of its own threads, one per request running (at most
--workers requests at once, uvicorn's limit beyond); a client that goes away cancels
its generation at once, which the engine ends at its next unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from inference_svc import log
from inference_svc.api import access, openai_api
from inference_svc.api.openai_api import JSON
from inference_svc.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    status_of,
)
from inference_svc.pb import inference_pb2 as pb
from inference_svc.sessions.names import SESSION_HEADER
from inference_svc.types import GenerateParams, RequestContext
from snapshot_svc.clientlib import auth
from snapshot_svc.clientlib.streams import StreamLimit

if TYPE_CHECKING:
    from inference_svc.api.server import InferenceServicer
    from inference_svc.config import Config

# a body holds the prompt's text JSON-escaped (up to 6 bytes a byte: \u00XX) and the
# other fields: it may be this many times --max-prompt-bytes, plus BODY_SLACK
BODY_FACTOR = 6
BODY_SLACK = 64 << 10
DRAIN_MAX = 64 << 20  # an oversized body is read (not kept) this far for its 400 to arrive
BODY_S = 30.0  # the longest a body may take to arrive (a stalled client holds a connection)
HEAD_S = 30.0  # the longest a new connection may take to send its first request's head
START_S = 10.0  # the longest the listener may take to come up
STOP_S = 5.0  # the longest the door's thread may take to end after its last response


def _protocol(head_s: Callable[[], float]) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with a bound on a new connection's silence: one that has
    not sent its first request's head within head_s() seconds is closed (uvicorn bounds
    only the idle time between requests, and a silent connection counts against the
    door's connections until it goes)."""

    class Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(head_s(), self._head_timeout)

        def _head_timeout(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return Protocol


class _End:
    """The end of a generation's responses."""


END = _End()


class HttpDoor:
    """The HTTP door of one server: start() listens, stop() ends it."""

    def __init__(self, cfg: Config, servicer: InferenceServicer,
                 keys: auth.KeyRing | None, logger: logging.Logger,
                 count: Callable[[str, str], None], unary: StreamLimit) -> None:
        self.cfg, self.servicer, self.keys, self.log = cfg, servicer, keys, logger
        self.unary = unary  # the gRPC unary calls' per-key limit, shared
        self.count = count  # (method, code) -> the requests metric
        self.body_limit = BODY_FACTOR * cfg.max_prompt_bytes + BODY_SLACK
        self.pool = futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers,
                                               thread_name_prefix="http")
        self.created = int(time.time())
        self.body_timeout = BODY_S
        self.head_timeout = HEAD_S
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        # /chat/completions and /models without /v1 as llama.cpp's server serves them
        # (clients configured with a base URL lacking /v1); not /completions, which
        # is llama.cpp's own completion API there, of another shape
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> int:
        """Binds (errors here, not on the thread) and serves; returns the port."""
        cfg = self.cfg
        host = cfg.http_host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, cfg.http_port or 0), family=family, backlog=256)
        self.port = sock.getsockname()[1]
        tls: dict[str, Any] = {}
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            tls = dict(ssl_certfile=str(cfg.tls_cert), ssl_keyfile=str(cfg.tls_key))
            if cfg.tls_client_ca is not None:
                tls.update(ssl_ca_certs=str(cfg.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, http=_protocol(lambda: self.head_timeout),
                                ws="none", lifespan="off",
                                log_config=None, access_log=False, server_header=False,
                                limit_concurrency=cfg.grpc_workers,
                                timeout_graceful_shutdown=1, **tls)
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=lambda: asyncio.run(server.serve([sock])),
                                        name="http-door", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_S
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not server.started:
            sock.close()
            raise OSError(f"the HTTP door on {cfg.http_host}:{self.port} did not start")
        return self.port

    def stop(self) -> None:
        """Stops listening; open responses get uvicorn's graceful second."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=STOP_S)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ routes

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "Chat", openai_api.chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "Generate", openai_api.completion_request)

    async def models(self, request: Request) -> Response:
        """GetInfo's model: under the same key rights and per-key unary limit."""
        try:
            caller = self._caller(request, "GetInfo")
            with self.unary.hold(caller) if caller is not None else contextlib.nullcontext():
                body = self._model_list()
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return self._error(exc, "http:models")
        self.count("http:models", "OK")
        return JSONResponse(body)

    def _model_list(self) -> JSON:
        eng = self.servicer._rt().engine.owner  # the models and slots served
        draft = eng.draft
        model: JSON = {
            "id": _served(eng.target, self.cfg)[0].model, "object": "model",
            "created": self.created, "name": eng.target.name,
            "owned_by": "warmslot", "context_length": eng.n_ctx,
            "fingerprint": eng.target.fingerprint, "n_vocab": eng.target.n_vocab,
            "n_ctx_train": eng.target.hparams.n_ctx_train, "n_slots": eng.n_slots,
            "draft": None if draft is None else {"name": draft.name,
                                                 "fingerprint": draft.fingerprint}}
        return {"object": "list", "data": [model]}

    async def health(self, request: Request) -> Response:
        """Open (no key), as gRPC health: 200 when serving, 503 while loading or stopping."""
        if self.servicer.runtime is None:
            status, body = openai_api.error_body(*status_of(
                Unavailable("the server is loading its models or stopping")))
            return JSONResponse(body, status)
        return JSONResponse({"status": "ok"})

    # ------------------------------------------------------------------ the work

    def _caller(self, request: Request, method: str) -> auth.Principal | None:
        """The key's principal when the service has keys (None without); raises
        Unauthenticated or PermissionDenied as the gRPC gate does."""
        if self.keys is None:
            return None
        header = request.headers.get("authorization")
        principal = self.keys.authenticate([("authorization", header)] if header else [])
        if not access.allowed(access.SERVICE + method, principal):
            raise PermissionDenied(f"this API key ({principal.role}) may not call {method}")
        return principal

    async def _body(self, request: Request) -> bytes:
        """The body, refused (400) past the limit before it is all in memory, or when it
        has not arrived in full within body_timeout seconds."""
        try:
            async with asyncio.timeout(self.body_timeout):
                return await self._read_body(request)
        except TimeoutError:
            raise InvalidArgument(f"the request body did not arrive in full within "
                                  f"{self.body_timeout:g} s") from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.body_limit
        declared = request.headers.get("content-length")
        too_big = InvalidArgument(
            f"the request body is over {limit} bytes, the limit ({BODY_FACTOR} x "
            f"--max-prompt-bytes {self.cfg.max_prompt_bytes} + {BODY_SLACK})")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._drain(request, int(declared))
            raise too_big
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > limit:
                await self._drain(request, n)
                raise too_big
            parts.append(part)
        return b"".join(parts)

    async def _drain(self, request: Request, seen: int) -> None:
        """Reads (and drops) a refused body, up to DRAIN_MAX, so that a client still
        sending it gets its 400 rather than a reset connection."""
        if seen > DRAIN_MAX:
            return
        with contextlib.suppress(Exception):
            async for part in request.stream():
                seen += len(part)
                if seen > DRAIN_MAX:
                    return

    async def _complete(self, request: Request, method: str,
                        to_request: Callable[[JSON, str | None], openai_api.Request]
                        ) -> Response:
        name = "http:" + method
        try:
            caller = self._caller(request, method)
            req = to_request(openai_api.parse_body(await self._body(request)),
                             request.headers.get(SESSION_HEADER))
            rt = self.servicer._rt()
            served = _served(rt.engine.owner.target, self.cfg)
            if req.model is not None and req.model not in served[1]:
                raise NotFound(f"model {req.model!r} is not served here; this server serves "
                               f"{served[0].model!r} (GET /v1/models)")
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return self._error(exc, name)
        message = req.message
        if req.chat:
            def params_of(rc: RequestContext) -> GenerateParams:
                return GenerateParams.from_chat(message, rc)  # type: ignore[arg-type]
        else:
            def params_of(rc: RequestContext) -> GenerateParams:
                return GenerateParams.from_pb(message, rc)  # type: ignore[arg-type]
        run = _Run(self, caller, params_of)
        renderer = openai_api.Renderer(req, served[0], rt.rc.tokenizer)
        try:
            first = await run.next()
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            run.cancel()
            return self._error(exc, name)
        if req.stream:
            return StreamingResponse(self._events(run, renderer, first, name),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        watch = asyncio.ensure_future(_on_disconnect(request, run.cancel))
        try:
            rs = [first]
            while not rs[-1].done:
                rs.append(await run.next())
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            return self._error(exc, name)
        finally:
            watch.cancel()
            run.cancel()
        self.count(name, "OK")
        return JSONResponse(renderer.whole(rs))

    async def _events(self, run: _Run, renderer: openai_api.Renderer,
                      first: pb.GenerateResponse, name: str) -> AsyncIterator[bytes]:
        """The SSE stream; an error after the first event is an event of its own. Leaving
        early (the client went away: Starlette cancels this) cancels the generation."""
        try:
            head = renderer.first()
            out = [openai_api.sse(head)] if head is not None else []
            r = first
            while True:
                out += [openai_api.sse(c) for c in renderer.chunks(r)]
                if r.done:
                    out.append(openai_api.sse("[DONE]"))
                    yield b"".join(out)
                    self.count(name, "OK")
                    return
                yield b"".join(out)
                out = []
                try:
                    r = await run.next()
                except asyncio.CancelledError:  # the client went away
                    self.count(name, "CANCELLED")
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    code, message = status_of(exc)
                    self._logged(exc, name, code.name)
                    yield openai_api.sse(openai_api.error_body(code, message)[1])
                    return
        finally:
            run.cancel()

    def _error(self, exc: BaseException, name: str) -> Response:
        code, message = status_of(exc)
        self._logged(exc, name, code.name)
        status, body = openai_api.error_body(code, message, getattr(exc, "param", None))
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(body, status, headers=headers)

    def _logged(self, exc: BaseException, name: str, code: str) -> None:
        self.count(name, code)
        if code == "INTERNAL":
            self.log.error("internal_error", exc_info=exc, extra=log.fields(method=name))
        else:
            self.log.info("http_failed", extra=log.fields(method=name, code=code,
                                                          message=str(exc)))

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (no such path, a wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        return JSONResponse({"error": {
            "message": f"{request.method} {request.url.path}: {exc.detail}",
            "type": openai_api.ERROR_TYPE.get(status, "invalid_request_error"),
            "param": None, "code": "not_found" if status == 404 else None}}, status)


def _served(model: Any, cfg: Config) -> tuple[openai_api.Served, frozenset[str]]:
    """What responses name the model and the names a request may give it: its id (its
    file's name without `.gguf`, as llama.cpp names it), its file's name and its GGUF
    name."""
    path = cfg.model
    model_id = path.name.removesuffix(".gguf")
    return (openai_api.Served(model_id, "fp_" + model.fingerprint[:16]),
            frozenset((model_id, path.name, model.name)))


async def _on_disconnect(request: Request, then: Callable[[], None]) -> None:
    """then() once the client goes away (uvicorn reports it at once)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return


class _Run:
    """One generation on the door's pool: the thread runs the shared layer
    (InferenceServicer.generation) and hands each response to the event loop."""

    def __init__(self, door: HttpDoor, caller: auth.Principal | None,
                 params_of: Callable[[RequestContext], GenerateParams]) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[pb.GenerateResponse | BaseException | _End] = asyncio.Queue()
        self.jobs: list[Any] = []
        self.cancelled = threading.Event()
        self.door = door
        door.pool.submit(self._work, caller, params_of)

    def _put(self, item: pb.GenerateResponse | BaseException | _End) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _work(self, caller: auth.Principal | None,
              params_of: Callable[[RequestContext], GenerateParams]) -> None:
        auth.CURRENT.set(caller)  # the sessions' owner
        try:
            with self.door.servicer.generation(params_of, caller, None) as gen:
                self.jobs.append(gen.job)
                if self.cancelled.is_set():
                    gen.job.cancel()
                for r in gen.responses:
                    self._put(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's task
            self._put(exc)
        else:
            self._put(END)

    async def next(self) -> pb.GenerateResponse:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _End):
            raise Unavailable("the generation ended without its last response")
        return item

    def cancel(self) -> None:
        self.cancelled.set()
        for job in self.jobs:
            job.cancel()
