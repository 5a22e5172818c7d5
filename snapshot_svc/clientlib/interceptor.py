"""The one server interceptor of both services: before a handler runs, a gate (API
keys, a draining server) may refuse the call; any exception of the handler becomes
its status code; a request that does not parse becomes INVALID_ARGUMENT (not
INTERNAL); every call is counted by method and status code; with API keys, a key's
unary calls running at once are limited (RESOURCE_EXHAUSTED beyond), so that one key's
flood of slow calls cannot take every handler thread. Health checks are left alone:
they stay open to probes without keys."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from snapshot_svc.clientlib import auth
from snapshot_svc.clientlib.errors import Cancelled, InvalidArgument, StatusError
from snapshot_svc.clientlib.jsonlog import log_event
from snapshot_svc.clientlib.streams import StreamLimit

HEALTH_PREFIX = "/grpc.health.v1.Health/"

# (method, context) -> the caller (None: no keys configured); raises StatusError
Gate = Callable[[str, grpc.ServicerContext], "auth.Principal | None"]


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """StatusError -> its code; anything else INTERNAL."""
    if isinstance(exc, StatusError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class _Malformed:
    """Stands for a request message that did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:  # e.g. a string field that is not valid UTF-8
            return _Malformed(str(exc) or "malformed request")

    return parse


def _check(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidArgument(f"malformed request: {request.error}")
    return request


def _checked(requests: Iterable[Any]) -> Iterator[Any]:
    for r in requests:
        yield _check(r)


class StatusInterceptor(grpc.ServerInterceptor):
    def __init__(self, count: Callable[[str, str], None], logger: logging.Logger,
                 gate: Gate | None = None,
                 status: Callable[[BaseException], tuple[grpc.StatusCode, str]] = status_of,
                 unary_limit: StreamLimit | None = None) -> None:
        self._count = count
        self._unary = unary_limit
        self._log = logger
        self._gate = gate
        self._status = status

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        full = details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        method = full.rsplit("/", 1)[-1]
        deser = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                return self._call(full, method, context, lambda: uu(_check(request), context),
                                  self._unary)

            return handler._replace(request_deserializer=deser, unary_unary=unary_unary)
        if handler.stream_unary:
            su = handler.stream_unary

            def stream_unary(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
                return self._call(full, method, context,
                                  lambda: su(_checked(requests), context))

            return handler._replace(request_deserializer=deser, stream_unary=stream_unary)
        if handler.unary_stream:
            us = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                return self._stream(full, method, context,
                                    lambda: us(_check(request), context))

            return handler._replace(request_deserializer=deser, unary_stream=unary_stream)
        ss = handler.stream_stream  # reflection

        def stream_stream(requests: Iterable[Any],
                          context: grpc.ServicerContext) -> Iterator[Any]:
            return self._stream(full, method, context,
                                lambda: ss(_checked(requests), context))

        return handler._replace(request_deserializer=deser, stream_stream=stream_stream)

    def _enter(self, full: str, context: grpc.ServicerContext) -> None:
        auth.CURRENT.set(None)
        if self._gate is not None:
            auth.CURRENT.set(self._gate(full, context))

    def _fail(self, method: str, context: grpc.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, grpc.RpcError | Cancelled) or not context.is_active():
            self._count(method, "CANCELLED")
            log_event(self._log, logging.INFO, "rpc_cancelled", method=method)
            if isinstance(exc, grpc.RpcError):
                raise exc  # raised by grpc itself (the request stream broke): it knows
            context.abort(grpc.StatusCode.CANCELLED, "the client went away")
        code, message = self._status(exc)
        if code is grpc.StatusCode.INTERNAL:
            self._log.error("internal_error", exc_info=exc,
                            extra={"fields": {"method": method}})
        else:
            log_event(self._log, logging.INFO, "rpc_failed", method=method, code=code.name,
                      message=message)
        self._count(method, code.name)
        if isinstance(exc, StatusError) and exc.trailers():
            context.set_trailing_metadata(exc.trailers())  # e.g. a conflict's generations
        context.abort(code, message)

    def _call(self, full: str, method: str, context: grpc.ServicerContext,
              fn: Callable[[], Any], limit: StreamLimit | None = None) -> Any:
        try:
            self._enter(full, context)
            caller = auth.CURRENT.get()
            if limit is None or caller is None:  # no keys: no key to limit
                response = fn()
            else:
                with limit.hold(caller):
                    response = fn()
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            self._fail(method, context, exc)
            raise  # unreachable: _fail raises
        self._count(method, "OK")
        return response

    def _stream(self, full: str, method: str, context: grpc.ServicerContext,
                fn: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        try:
            self._enter(full, context)
            yield from fn()
        except GeneratorExit:
            self._count(method, "CANCELLED")
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            self._fail(method, context, exc)
            raise  # unreachable: _fail raises
        self._count(method, "OK")
