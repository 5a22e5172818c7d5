"""A pytest plugin for llama.cpp's server test suite run against this server
(tools/llama_server_suite.py --adapt): every request's `model` is replaced with the
model this server serves.

llama.cpp's server answers whatever model name a request gives; this one answers 404
for a model it does not serve, as OpenAI's API and vLLM do. The suite's requests name
models of other servers ("gpt-3.5-turbo-instruct", "davinci-002", "codellama70b"); with
them replaced, the tests about response shape, logprobs and keys that send them run
here. Nothing else of a test changes: a test that expects the texts or token counts
of the suite's own model still fails, and is listed as such in docs/http-api.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai.resources.chat.completions as chat_completions
import openai.resources.completions as completions
import requests

from tools.llama_server_shim import served_model

SERVED = Path(served_model()).name.removesuffix(".gguf")


def _with_served_model(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        body = kwargs.get("json")
        if isinstance(body, dict) and body.get("model") is not None:
            kwargs["json"] = {**body, "model": SERVED}
        if isinstance(kwargs.get("model"), str):
            kwargs["model"] = SERVED
        return call(*args, **kwargs)
    return wrapped


def pytest_configure() -> None:
    requests.post = _with_served_model(requests.post)  # type: ignore[assignment]
    for cls in (chat_completions.Completions, completions.Completions):
        cls.create = _with_served_model(cls.create)  # type: ignore[method-assign]
