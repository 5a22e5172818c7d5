"""Logprobs and penalties through real gRPC (Generate and Chat, with and without
speculative decoding): the exact values and tokens the core's logits give, and every
bad value with INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.api.server import Server
from inference_svc.client import InferenceClient, make_request
from inference_svc.core.params import SamplingParams, TokenLogprob
from inference_svc.pb import inference_pb2 as pb
from tests.fixtures.servicekit import model_pair, running_with_template
from tests.test_penalties_logprobs import expected_logprobs, numpy_greedy, reference_logits

PROMPT = [5, 17, 250, 3, 99, 42, 7, 17, 17, 5]
N = 24
PENALTIES = dict(repeat_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.4,
                 repeat_last_n=24)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return model_pair(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with running_with_template(pair, tmp_path_factory.mktemp("sampling"), template) as srv:
        yield srv


def streamed(rs: list[pb.GenerateResponse]) -> tuple[list[int], list[TokenLogprob]]:
    toks = [t for r in rs for t in r.tokens]
    lps = [TokenLogprob(lp.token, lp.logprob, [(a.token, a.logprob) for a in lp.top])
           for r in rs for lp in r.logprobs]
    for r in rs:  # one per token when asked, else none
        assert len(r.logprobs) == (len(r.tokens) if lps else 0)
    return toks, lps


@pytest.mark.parametrize("spec", [True, False])
def test_generate_logprobs_exact(client: InferenceClient, pair: tuple[Path, Path],
                                 spec: bool) -> None:
    rs, last = client.generate(PROMPT, max_tokens=N, temperature=0.7, seed=5, logprobs=4,
                               speculative=spec)
    toks, lps = streamed(rs)
    assert len(toks) == N and [lp.token for lp in lps] == toks
    if spec:
        assert last.timings.draft_n > 0
    rows = reference_logits(pair[0], PROMPT, toks)
    assert lps == [expected_logprobs(rows[i], toks[i], 4) for i in range(N)]


def test_no_logprobs_unless_asked(client: InferenceClient) -> None:
    rs, _ = client.generate(PROMPT, max_tokens=4)
    assert all(len(r.logprobs) == 0 for r in rs)


def test_chat_logprobs(client: InferenceClient, pair: tuple[Path, Path]) -> None:
    text = "hello there"
    prompt = client.tokenize(text)
    rs, _ = client.chat([("user", text)], max_tokens=8, temperature=0.0, logprobs=20)
    toks, lps = streamed(rs)
    rows = reference_logits(pair[0], prompt, toks)
    assert lps == [expected_logprobs(rows[i], toks[i], 20) for i in range(8)]


def test_penalties_greedy_spec_equals_target_only(client: InferenceClient,
                                                  pair: tuple[Path, Path]) -> None:
    expected = numpy_greedy(pair[0], PROMPT, N, SamplingParams(**PENALTIES))  # type: ignore[arg-type]
    assert expected != numpy_greedy(pair[0], PROMPT, N, SamplingParams())
    spec_rs, spec_last = client.generate(PROMPT, max_tokens=N, temperature=0.0,
                                         speculative=True, **PENALTIES)
    client.erase(spec_last.timings.id_slot)
    plain_rs, plain_last = client.generate(PROMPT, max_tokens=N, temperature=0.0,
                                           speculative=False, **PENALTIES)
    assert spec_last.timings.draft_n > 0 and plain_last.timings.draft_n == 0
    assert streamed(spec_rs)[0] == streamed(plain_rs)[0] == expected


def test_default_sampling_reported(client: InferenceClient) -> None:
    d = client.info().default_sampling
    assert (d.repeat_penalty, d.repeat_last_n, d.presence_penalty, d.frequency_penalty) == \
        (1.0, 64, 0.0, 0.0)


@pytest.mark.parametrize("fields, message", [
    ({"repeat_penalty": 10.5}, "repeat_penalty 10.5 is outside [0, 10]"),
    ({"repeat_penalty": -1.0}, "repeat_penalty -1 is outside [0, 10]"),
    ({"repeat_penalty": float("nan")}, "repeat_penalty nan is outside [0, 10]"),
    ({"repeat_last_n": -1}, "repeat_last_n -1 is outside 0..4096"),
    ({"repeat_last_n": 5000}, "repeat_last_n 5000 is outside 0..4096"),
    ({"presence_penalty": 2.5}, "presence_penalty 2.5 is outside [-2, 2]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty -3 is outside [-2, 2]"),
    ({"logprobs": 21}, "logprobs 21 is outside 0..20"),
    ({"logprobs": -2}, "logprobs -2 is outside 0..20"),
])
def test_bad_values(client: InferenceClient, fields: dict[str, float], message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate_stream(make_request(PROMPT, max_tokens=2, **fields)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
