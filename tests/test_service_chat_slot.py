"""Chat's id_slot and cache_prompt (as Generate's), through gRPC and the HTTP door alike:
the conversation runs on the slot asked for, reuses that slot's prefix unless told not to,
and neither goes with a session."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from inference_svc.api.server import Server
from tests.fixtures.servicekit import running
from tests.httpkit import MODEL_ID, client, grpc_client, http_config

CONVERSATION = [("system", "You write Python."), ("user", "Sort a list.")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(http_config(tmp_path_factory.mktemp("chat-slot"))) as srv:
        yield srv


def test_chat_on_a_slot(server: Server) -> None:
    with grpc_client(server) as c:
        _, first = c.chat(CONVERSATION, max_tokens=4, temperature=0.0, id_slot=1)
        assert (first.timings.id_slot, first.timings.cache_n) == (1, 0)
        n = first.timings.prompt_n
        _, again = c.chat(CONVERSATION, max_tokens=4, temperature=0.0, id_slot=1)
        assert (again.timings.id_slot, again.timings.cache_n) == (1, n - 1)
        _, cold = c.chat(CONVERSATION, max_tokens=4, temperature=0.0, id_slot=1,
                         cache_prompt=False)
        assert (cold.timings.cache_n, cold.timings.prompt_n) == (0, n)
        with pytest.raises(grpc.RpcError) as err:
            c.chat(CONVERSATION, max_tokens=1, id_slot=0, session="s")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("a request with a session cannot set id_slot: the "
                                       "session picks its slot and continues its own tokens")
    # the same over HTTP
    messages = [{"role": r, "content": t} for r, t in CONVERSATION]
    oa = client(server)
    r = oa.chat.completions.create(model=MODEL_ID, messages=messages,  # type: ignore[arg-type]
                                   max_tokens=4, temperature=0,
                                   extra_body={"id_slot": 0, "cache_prompt": False})
    t = (r.model_extra or {})["timings"]
    assert (t["id_slot"], t["cache_n"], t["prompt_n"]) == (0, 0, n)
    r = oa.chat.completions.create(model=MODEL_ID, messages=messages,  # type: ignore[arg-type]
                                   max_tokens=4, temperature=0, extra_body={"id_slot": 0})
    t = (r.model_extra or {})["timings"]
    assert (t["id_slot"], t["cache_n"]) == (0, n - 1)
