"""Helpers of the HTTP door's tests: a server of the bundled models with its HTTP door
on a free port, the official `openai` client of it, raw HTTP calls, and the gRPC
client of the same server (the expected output of a request is the gRPC path's)."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient
from inference_svc.config import Config
from tests.fixtures.servicekit import service_config

ROOT = Path(__file__).resolve().parent.parent
TARGET, DRAFT = ROOT / "models" / "target.gguf", ROOT / "models" / "draft.gguf"
MODEL_ID = "target"  # the bundled target's file name without .gguf
# a chat template for the bundled models (they have none): role, colon, content
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n"
            "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")


def http_config(directory: Path, **kw: Any) -> Config:
    """The bundled pair on 2 slots of 512 tokens, gRPC and HTTP on free ports, with a
    chat template (written in directory)."""
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    base: dict[str, Any] = dict(ctx=512, http_port=0, chat_template=template)
    base.update(kw)
    return service_config(TARGET, DRAFT, **base)


def client(srv: Server, key: str = "none", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=key,
                         max_retries=0, timeout=60, **kw)


@contextlib.contextmanager
def grpc_client(srv: Server, key: str | None = None) -> Iterator[InferenceClient]:
    """The gRPC client of the server, every slot erased first (a fresh start for the
    next request, whichever door it comes through)."""
    with InferenceClient(f"127.0.0.1:{srv.port}", timeout=60, api_key=key) as c:
        if key is None:
            for i in range(srv.cfg.slots):
                c.erase(i)
        yield c


def erase_all(srv: Server) -> None:
    with grpc_client(srv):
        pass


def raw(srv: Server, method: str, path: str, body: bytes | str | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post(srv: Server, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    """POSTs a JSON body (a str or bytes is sent as it is): (status, parsed answer)."""
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    status, _, out = raw(srv, "POST", path, data, {"Content-Type": "application/json",
                                                   **headers})
    return status, json.loads(out)


def error(status: int, message: str, code: str, param: str | None = None) -> tuple[int, Any]:
    """The answer of a failed request."""
    kind = {400: "invalid_request_error", 401: "authentication_error",
            404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
            503: "unavailable_error"}[status]
    return status, {"error": {"message": message, "type": kind, "param": param,
                              "code": code}}
