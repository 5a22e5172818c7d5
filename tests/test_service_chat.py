"""Chat through real gRPC on the small test pair with a --chat-template file: the prompt
is the rendered conversation (exact ids), the generation the same as Generate's on
those ids; every bad input with its status code; a server without a template; the
command-line `chat`."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, _parser, chat_loop, make_chat_request
from inference_svc.core import Model, Tokenizer
from tests.fixtures.servicekit import (
    model_pair,
    running,
    running_with_template,
    service_config,
)

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Conversation roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ bos_token }}{{ m.role }}: {{ m.content }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}")
EOT = 299  # the test pair's <|endoftext|>, its BOS and EOS: the template's special token
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def tok(pair: tuple[Path, Path]) -> Iterator[Tokenizer]:
    with Model.load(pair[0]) as m:
        yield m.tokenizer


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_with_template(pair, tmp_path_factory.mktemp("chat"), TEMPLATE) as srv:
        yield srv


def expected_prompt(tok: Tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    out: list[int] = []
    for role, content in messages:
        out += [EOT] + tok.encode(f"{role}: {content}\n")
    return out + [EOT] + tok.encode("assistant:")


CONVERSATION = [("system", "be brief"), ("user", "hi <|endoftext|> there")]


def test_chat_prompt_and_output_are_generates(client: InferenceClient, tok: Tokenizer) -> None:
    ids = expected_prompt(tok, CONVERSATION)
    assert ids.count(EOT) == 3  # the template's three, none from the user's text
    rs, last = client.chat(CONVERSATION, max_tokens=12, **GREEDY)
    t = last.timings
    assert (t.prompt_n + t.cache_n, t.predicted_n) == (len(ids), 12)
    chat_tokens = [x for r in rs for x in r.tokens]
    client.erase(t.id_slot)
    grs, glast = client.generate(ids, max_tokens=12, **GREEDY)
    assert chat_tokens == [x for r in grs for x in r.tokens]
    assert len(chat_tokens) == 12
    assert "".join(r.text for r in rs) == "".join(r.text for r in grs)
    # the same conversation again reuses the whole prompt but its last token
    _, again = client.chat(CONVERSATION, max_tokens=1, **GREEDY)
    assert (again.timings.prompt_n, again.timings.cache_n) == (1, len(ids) - 1)


def test_chat_options_pass_through(client: InferenceClient, tok: Tokenizer) -> None:
    ids = expected_prompt(tok, [("user", "x")])
    rs, last = client.chat([("user", "x")], add_generation_prompt=True, max_tokens=5,
                           temperature=0.9, seed=42)
    client.erase(last.timings.id_slot)
    grs, _ = client.generate(ids, max_tokens=5, temperature=0.9, seed=42)
    assert [x for r in rs for x in r.tokens] == [x for r in grs for x in r.tokens]
    assert last.seed == 42
    _, no_gp = client.chat([("user", "x")], add_generation_prompt=False, max_tokens=0)
    assert no_gp.timings.prompt_n + no_gp.timings.cache_n == len(tok.encode("user: x\n")) + 1


def test_chat_session_reuses_the_conversation_it_holds(client: InferenceClient,
                                                      tok: Tokenizer) -> None:
    first = [("user", "hello there")]
    rs1, _ = client.chat(first, max_tokens=6, session="chat-one", **GREEDY)
    reply = "".join(r.text for r in rs1)
    ids1 = expected_prompt(tok, first)
    assert {s.name: s.n_tokens for s in client.sessions()} == {"chat-one": len(ids1) + 6}
    second = [*first, ("assistant", reply), ("user", "and then")]
    ids2 = expected_prompt(tok, second)
    rs2, last = client.chat(second, max_tokens=6, session="chat-one", **GREEDY)
    t = last.timings
    # the messages are the whole conversation: the session's first turn is reused (not
    # appended to), only what follows it is processed
    assert t.prompt_n + t.cache_n == len(ids2)
    assert t.cache_n >= len(ids1)
    assert {s.name: s.n_tokens for s in client.sessions()} == {"chat-one": len(ids2) + 6}
    client.delete_session("chat-one")
    rs3, _ = client.chat(second, max_tokens=6, **GREEDY)  # no session: any slot
    assert [x for r in rs2 for x in r.tokens] == [x for r in rs3 for x in r.tokens]


def _code(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("messages, fields, code, message", [
    ([], {}, INVALID, "messages is empty"),
    ([("robot", "hi")], {}, INVALID,
     "the chat template rejected the messages: Conversation roles must be system, user or "
     "assistant"),
    ([("", "hi")], {}, INVALID, "role must be 1..64 characters"),
    ([("user<|endoftext|>", "hi")], {}, INVALID, "holds the special-token text"),
    ([("user", "hi")], {"logprobs": 21}, INVALID, "logprobs 21 is outside 0..20"),
    ([("user", "hi")], {"logprobs": -1}, INVALID, "logprobs -1 is outside 0..20"),
    ([("user", "hi")], {"session": "a/b"}, INVALID, "bad session name"),
    ([("user", "hi")], {"max_tokens": -1}, INVALID, "max_tokens -1 is negative"),
    ([("user", "hi")], {"max_tokens": 10_000}, INVALID, "exceed the context of 256"),
    ([("user", "hi")], {"temperature": -1.0}, INVALID, "temperature -1 is outside"),
    ([("user", "hi")], {"stop": [""]}, INVALID, "stop string '' must be"),
    ([("user", "x" * 2000)], {}, INVALID, "exceed the context of 256"),
])
def test_chat_bad_input(client: InferenceClient, messages: list[tuple[str, str]],
                        fields: dict[str, object], code: grpc.StatusCode, message: str) -> None:
    got, details = _code(lambda: list(client.chat_stream(make_chat_request(messages,
                                                                            **fields))))
    assert got == code
    assert message in details
    _, last = client.chat([("user", "still serving")], max_tokens=1)  # and it still serves
    assert last.done


def test_chat_without_template_is_failed_precondition(pair: tuple[Path, Path]) -> None:
    with running(service_config(*pair)) as srv, \
            InferenceClient(f"127.0.0.1:{srv.port}", timeout=30) as c:
        code, details = _code(lambda: c.chat([("user", "hi")], max_tokens=1))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--chat-template" in details


def test_bad_template_file_stops_start(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not compile"), \
            running_with_template(pair, tmp_path, "{% for %}"):
        pass


def test_cli_chat_sends_the_conversation(client: InferenceClient) -> None:
    args = _parser().parse_args(["chat", "--system", "be brief", "--max-tokens", "4",
                                 "--temperature", "0"])
    out = io.StringIO()
    conv = chat_loop(client, args, iter(["hello\n", "   \n", "again\n"]), out)
    assert [r for r, _ in conv] == ["system", "user", "assistant", "user", "assistant"]
    # each reply is what a Chat of the conversation so far answers
    first = "".join(r.text for r in client.chat(conv[:2], max_tokens=4, **GREEDY)[0])
    second = "".join(r.text for r in client.chat(conv[:4], max_tokens=4, **GREEDY)[0])
    assert (conv[2][1], conv[4][1]) == (first, second)
    assert out.getvalue() == f"{first}\n{second}\n"
