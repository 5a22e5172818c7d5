"""The HTTP door through the official `openai` client on the bundled models: every answer
is the gRPC path's for the same request on the same server (text, tokens' logprobs,
counts), streamed and not, chat and completions; usage, stop, model list, health."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from inference_svc.api.server import Server
from tests.fixtures.servicekit import running
from tests.httpkit import MODEL_ID, client, erase_all, grpc_client, http_config, post, raw

PROMPT = "def merge_sorted(a, b):"
CHAT = [("system", "You write Python."), ("user", "Sort a list of numbers.")]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("http-api")
    with running(http_config(d)) as srv:
        yield srv


@pytest.fixture()
def oa(server: Server) -> openai.OpenAI:
    return client(server)


def _grpc_text(server: Server, prompt: str | list[int], **kw: object) -> tuple[str, object]:
    with grpc_client(server) as c:
        rs, last = c.generate(prompt, **kw)  # type: ignore[arg-type]
    return "".join(r.text for r in rs), last


def _grpc_chat(server: Server, **kw: object) -> tuple[str, object, list[object]]:
    with grpc_client(server) as c:
        rs, last = c.chat(CHAT, **kw)  # type: ignore[arg-type]
    return "".join(r.text for r in rs), last, [lp for r in rs for lp in r.logprobs]


def _messages() -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in CHAT]


def test_completion_is_generates(server: Server, oa: openai.OpenAI) -> None:
    text, last = _grpc_text(server, PROMPT, max_tokens=24, **GREEDY)
    with grpc_client(server):  # fresh slots for the HTTP request too
        pass
    r = oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == text and len(text) > 0
    assert r.choices[0].finish_reason == "length"
    t = last.timings  # type: ignore[attr-defined]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        t.prompt_n + t.cache_n, 24, t.prompt_n + t.cache_n + 24)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model == MODEL_ID and r.object == "text_completion"
    extra = r.model_extra or {}
    assert extra["timings"]["prompt_n"] == t.prompt_n
    assert extra["timings"]["predicted_n"] == 24
    # the same prompt again: all of it but its last token comes from the slot
    again = oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == t.prompt_n - 1
    assert (again.model_extra or {})["timings"]["prompt_n"] == 1


def test_streamed_completion_is_generates(server: Server, oa: openai.OpenAI) -> None:
    text, last = _grpc_text(server, PROMPT, max_tokens=40, **GREEDY)
    with grpc_client(server):
        pass
    chunks = list(oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    *body, usage = chunks
    assert usage.choices == [] and all(c.usage is None for c in body)
    t = last.timings  # type: ignore[attr-defined]
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (t.prompt_n, 40)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_prompt_as_token_ids(server: Server, oa: openai.OpenAI) -> None:
    with grpc_client(server) as c:
        ids = c.tokenize(PROMPT)
    text, _ = _grpc_text(server, ids, max_tokens=8, **GREEDY)
    with grpc_client(server):
        pass
    r = oa.completions.create(model=MODEL_ID, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(ids)


def test_sampled_with_seed_is_generates(server: Server, oa: openai.OpenAI) -> None:
    """temperature, top_p, penalties and seed reach the sampler as gRPC's do."""
    kw = dict(temperature=0.9, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
              seed=1234)
    text, _ = _grpc_text(server, PROMPT, max_tokens=32, **kw)
    with grpc_client(server):
        pass
    r = oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=32, **kw)
    assert r.choices[0].text == text
    greedy, _ = _grpc_text(server, PROMPT, max_tokens=32, **GREEDY)
    assert text != greedy  # the sampling settings did change the output


def test_chat_is_grpc_chat(server: Server, oa: openai.OpenAI) -> None:
    text, last, _ = _grpc_chat(server, max_tokens=20, **GREEDY)
    with grpc_client(server):
        pass
    r = oa.chat.completions.create(model=MODEL_ID, messages=_messages(),  # type: ignore[arg-type]
                                   max_completion_tokens=20, temperature=0)
    m = r.choices[0].message
    assert (m.role, m.content) == ("assistant", text)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == last.timings.prompt_n  # type: ignore[attr-defined]
    with grpc_client(server):
        pass
    chunks = list(oa.chat.completions.create(model=MODEL_ID, messages=_messages(),  # type: ignore[arg-type]
                                             max_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_content_parts(server: Server, oa: openai.OpenAI) -> None:
    text, _, _ = _grpc_chat(server, max_tokens=6, **GREEDY)
    with grpc_client(server):
        pass
    parts = [{"role": "system", "content": [{"type": "text", "text": "You write "},
                                            {"type": "text", "text": "Python."}]},
             {"role": "user", "content": CHAT[1][1]}]
    r = oa.chat.completions.create(model=MODEL_ID, messages=parts,  # type: ignore[arg-type]
                                   max_tokens=6, temperature=0)
    assert r.choices[0].message.content == text


def test_stop_string(server: Server, oa: openai.OpenAI) -> None:
    full, _ = _grpc_text(server, PROMPT, max_tokens=40, **GREEDY)
    stop = full[len(full) // 2:][:3]
    assert stop and stop in full
    expect, last = _grpc_text(server, PROMPT, max_tokens=40, stop=[stop], **GREEDY)
    assert last.stop_string == stop and expect == full[:full.index(stop)]  # type: ignore[attr-defined]
    with grpc_client(server):
        pass
    r = oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40, temperature=0,
                              stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expect, "stop")
    with grpc_client(server):
        pass
    chunks = list(oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=[stop, "\x00never"],
                                        stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(server: Server, oa: openai.OpenAI) -> None:
    text, _, lps = _grpc_chat(server, max_tokens=10, logprobs=3, **GREEDY)
    with grpc_client(server) as c:
        pieces = {lp.token: c.detokenize([lp.token]) for lp in lps}
        pieces |= {t.token: c.detokenize([t.token]) for lp in lps for t in lp.top}
    r = oa.chat.completions.create(model=MODEL_ID, messages=_messages(),  # type: ignore[arg-type]
                                   max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(x.token, x.logprob) for x in content] == [
        (pieces[lp.token], pytest.approx(lp.logprob, abs=1e-6)) for lp in lps]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in content] == [
        [(pieces[t.token], pytest.approx(t.logprob, abs=1e-6)) for t in lp.top] for lp in lps]
    assert "".join(x.token for x in content) == text
    assert all(bytes(x.bytes or []).decode() == x.token for x in content)
    # logprobs without alternatives: top_logprobs 0
    with grpc_client(server):
        pass
    r0 = oa.chat.completions.create(model=MODEL_ID, messages=_messages(),  # type: ignore[arg-type]
                                    max_tokens=10, temperature=0, logprobs=True)
    c0 = r0.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [x.logprob for x in c0] == [x.logprob for x in content]
    assert all(x.top_logprobs == [] for x in c0)


def test_completion_logprobs_streamed(server: Server, oa: openai.OpenAI) -> None:
    text, _ = _grpc_text(server, PROMPT, max_tokens=12, **GREEDY)
    with grpc_client(server):
        pass
    chunks = list(oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12,
                                        temperature=0, logprobs=2, stream=True))
    tokens, offsets, tops = [], [], []
    for c in chunks:
        lp = c.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens or []
            offsets += lp.text_offset or []
            tops += lp.top_logprobs or []
    assert "".join(tokens) == text and len(tokens) == 12
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(12)]
    assert all(len(t) == 2 for t in tops)  # greedy: the chosen token is the likeliest
    assert all(max(t.values()) == pytest.approx(lp) for t, lp in zip(
        tops, [v for c in chunks if c.choices[0].logprobs
               for v in c.choices[0].logprobs.token_logprobs or []], strict=True))


def test_eos_finish_reason_is_stop(server: Server) -> None:
    """A generation that ends on the model's EOS reports 'stop': min_p 0 and temperature 0
    from the prompt that ends a file."""
    body = {"prompt": "x = 1\n", "max_tokens": 400, "temperature": 0}
    with grpc_client(server) as c:
        _, last = c.generate(body["prompt"], max_tokens=400, temperature=0.0)
    status, _, out = raw(server, "POST", "/v1/completions", json.dumps(body))
    answer = json.loads(out)
    reason = "stop" if last.stop_reason == 1 else "length"
    assert status == 200 and answer["choices"][0]["finish_reason"] == reason


def test_models_and_health(server: Server, oa: openai.OpenAI) -> None:
    models = oa.models.list().data
    assert [m.id for m in models] == [MODEL_ID]
    extra = models[0].model_extra or {}
    rt = server.servicer.runtime
    assert rt is not None
    assert extra["context_length"] == 512
    assert extra["fingerprint"] == rt.engine.owner.target.fingerprint
    assert extra["draft"]["fingerprint"] == rt.engine.owner.draft.fingerprint  # type: ignore[union-attr]
    status, _, body = raw(server, "GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert extra["name"] == "warmslot-target"  # its GGUF name
    # the model's file name and GGUF name name it too
    for name in ("target.gguf", "warmslot-target"):
        r = oa.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert r.model == MODEL_ID


def test_paths_without_v1_as_llama_cpp_serves_them(server: Server) -> None:
    status, _, body = raw(server, "GET", "/models")
    status_v1, _, body_v1 = raw(server, "GET", "/v1/models")
    assert (status, json.loads(body)) == (status_v1, json.loads(body_v1)) == (
        200, json.loads(body_v1))
    req = {"messages": _messages(), "max_tokens": 6, "temperature": 0}
    answers = []
    for path in ("/chat/completions", "/v1/chat/completions"):
        with grpc_client(server):  # fresh slots: the same work for both
            pass
        code, out = post(server, path, req)
        assert code == 200
        answers.append((out["choices"][0]["message"]["content"], out["usage"]))
    assert answers[0] == answers[1]
    # llama.cpp's /completions is its own API, not OpenAI's: not served here
    assert raw(server, "POST", "/completions", json.dumps({"prompt": PROMPT}))[0] == 404


def test_sse_bytes(server: Server) -> None:
    """The wire format itself: `data: {json}` events separated by blank lines, then
    `data: [DONE]`."""
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "stream": True}
    status, headers, out = raw(server, "POST", "/v1/completions", json.dumps(body))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = out.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    parsed = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["timings"]["predicted_n"] == 4


def test_disconnect_cancels_the_generation(server: Server) -> None:
    """A client that goes away mid-stream: its generation stops (the slot is free again
    long before max_tokens would have been reached)."""
    rt = server.servicer.runtime
    assert rt is not None
    oa = client(server)
    stream = oa.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=480,
                                   temperature=0.8, stream=True)
    next(iter(stream))
    assert rt.engine.n_running() == 1
    t0 = time.monotonic()
    stream.close()
    while rt.engine.n_running() and time.monotonic() - t0 < 5:
        time.sleep(0.005)
    assert rt.engine.n_running() == 0
    slots = {s.id: s for s in rt.engine.list_slots()}
    assert not any(s.busy for s in slots.values())
    assert max(s.n_tokens for s in slots.values()) < 480


def test_non_streamed_disconnect_cancels(server: Server, tmp_path: Path) -> None:
    """A client of a non-streamed request that goes away: the generation stops too."""
    import socket

    rt = server.servicer.runtime
    assert rt is not None
    body = json.dumps({"prompt": PROMPT, "max_tokens": 480, "temperature": 0.8}).encode()
    s = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    t0 = time.monotonic()
    while not rt.engine.n_running() and time.monotonic() - t0 < 10:
        time.sleep(0.002)
    assert rt.engine.n_running() == 1
    s.close()
    t1 = time.monotonic()
    while rt.engine.n_running() and time.monotonic() - t1 < 5:
        time.sleep(0.005)
    assert rt.engine.n_running() == 0
    assert max(s.n_tokens for s in rt.engine.list_slots()) < 480


def test_cli_over_http(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """The client CLI's --http mode: generate, chat and models through the HTTP door give
    the gRPC text."""
    import io

    from inference_svc import client as cli

    text, _ = _grpc_text(server, PROMPT, max_tokens=10, **GREEDY)
    erase_all(server)
    url = f"http://127.0.0.1:{server.http_port}"
    assert cli.main(["--http", url, "generate", PROMPT, "--max-tokens", "10",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == PROMPT + text
    assert "length: prompt " in out.err and "10 generated" in out.err
    chat_text, _, _ = _grpc_chat(server, max_tokens=6, **GREEDY)
    erase_all(server)
    a = cli._parser().parse_args(["--http", url, "chat", "--system", CHAT[0][1],
                                  "--max-tokens", "6", "--temperature", "0"])
    sink = io.StringIO()
    convo = cli.http_chat_loop(a, iter([CHAT[1][1] + "\n"]), sink, None, None)
    assert sink.getvalue() == chat_text + "\n" and convo[-1] == ("assistant", chat_text)
    assert cli.main(["--http", url, "models"]) == 0
    assert json.loads(capsys.readouterr().out)["data"][0]["id"] == MODEL_ID
    assert cli.main(["--http", url, "generate", PROMPT, "--temperature", "500"]) == 1
    assert capsys.readouterr().err == "error: HTTP 400: temperature 500 is outside [0, 100]\n"


def test_defaults_are_the_servers(tmp_path: Path) -> None:
    """A request that sets nothing gets the server's defaults through either door:
    --default-max-tokens, --temperature 0 (greedy) and the speculative defaults."""
    from dataclasses import replace

    from inference_svc.config import DEFAULT_SAMPLING

    cfg = http_config(tmp_path, default_max_tokens=17,
                      sampling=replace(DEFAULT_SAMPLING, temperature=0.0))
    with running(cfg) as srv:
        with grpc_client(srv) as c:
            rs, last = c.generate(PROMPT)
        erase_all(srv)
        r = client(srv).completions.create(model=MODEL_ID, prompt=PROMPT)
    assert r.usage.completion_tokens == last.timings.predicted_n == 17
    assert r.choices[0].text == "".join(x.text for x in rs)
    t = (r.model_extra or {})["timings"]
    assert (t["draft_n"], t["draft_n_accepted"]) == (last.timings.draft_n,
                                                     last.timings.draft_n_accepted)
    assert t["draft_n"] > 0  # speculative decoding on by default with a draft
