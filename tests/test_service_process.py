"""The service as a process: configuration from flags and WARMSLOT_* variables,
the command-line client, JSON logs, and a graceful stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc import config
from inference_svc.client import InferenceClient, make_request
from tests.fixtures.servicekit import SLOW, Reference, model_pair

ROOT = Path(__file__).resolve().parent.parent


def test_flags_beat_environment_beats_defaults(tmp_path: Path) -> None:
    env = {"WARMSLOT_SLOTS": "3", "WARMSLOT_DRAFT": "none", "WARMSLOT_PORT": "6000",
           "WARMSLOT_SLOT_SAVE_PATH": str(tmp_path), "WARMSLOT_DRAFT_RESTORE_POLICY": "empty",
           "WARMSLOT_SPEC_N_MAX": "4", "WARMSLOT_TEMPERATURE": "0"}
    cfg = config.from_args(["--port", "7000", "--ctx", "512"], env)
    assert (cfg.slots, cfg.draft, cfg.port, cfg.ctx) == (3, None, 7000, 512)
    assert cfg.slot_save_path == tmp_path and cfg.draft_restore_policy == "empty"
    assert cfg.speculative.n_max == 4 and cfg.sampling.temperature == 0.0
    d = config.from_args([], {})
    assert d == config.Config() and d.model == config.DEFAULT_MODEL
    assert d.draft == config.DEFAULT_DRAFT and d.host == "127.0.0.1"
    with pytest.raises(SystemExit):
        config.from_args(["--slots", "0"], {})
    with pytest.raises(SystemExit):
        config.from_args([], {"WARMSLOT_DRAFT_RESTORE_POLICY": "maybe"})
    with pytest.raises(dataclass_frozen_error()):
        d.slots = 2  # type: ignore[misc]


def dataclass_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


class Proc:
    def __init__(self, popen: subprocess.Popen[str]) -> None:
        self.p = popen
        self.lines: list[dict[str, object]] = []
        self.port = 0
        self.grace = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = {"msg": "raw", "line": line}
            self.lines.append(rec)
            if rec.get("msg") == "listening":
                self.port = int(rec["port"])  # type: ignore[arg-type]
            if rec.get("msg") in ("serving", "cannot start"):
                self._ready.set()
        self._ready.set()

    def wait_serving(self, timeout: float = 60) -> None:
        assert self._ready.wait(timeout), "the service did not start"
        assert any(r.get("msg") == "serving" for r in self.lines), self.lines

    def messages(self) -> list[object]:
        return [r.get("msg") for r in self.lines]


@pytest.fixture(params=["5"])
def proc(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
         request: pytest.FixtureRequest) -> Iterator[Proc]:
    """The service with the small test pair, or the slow one for a grace period test."""
    grace = request.param
    if grace == "5":
        target, draft = model_pair(tmp_path_factory.getbasetemp())
    else:
        target, draft = model_pair(tmp_path_factory.getbasetemp(), "slow", shape=SLOW)
    env = dict(os.environ, WARMSLOT_MODEL=str(target), WARMSLOT_DRAFT=str(draft),
               WARMSLOT_SLOTS="2", WARMSLOT_CTX="256" if grace == "5" else "512",
               WARMSLOT_PORT="0",
               WARMSLOT_SLOT_SAVE_PATH=str(tmp_path / "slots"), WARMSLOT_LOG_FORMAT="json",
               WARMSLOT_SHUTDOWN_GRACE=grace)
    p = subprocess.Popen([sys.executable, "-m", "inference_svc", "--threads", "1",
                          "--host", "127.0.0.1"], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True)
    pr = Proc(p)
    pr.grace = grace
    try:
        pr.wait_serving()
        yield pr
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def cli(port: int, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "inference_svc.client", "--addr",
                        f"127.0.0.1:{port}", "--timeout", "30", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cli_client_against_the_process(proc: Proc,
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    port = proc.port
    ref = Reference(*model_pair(tmp_path_factory.getbasetemp()))
    info = json.loads(cli(port, "info"))
    assert info["nSlots"] == 2 and info["nCtx"] == 256 and info["storeConfigured"]
    last = json.loads(cli(port, "generate", "hello", "--max-tokens", "8", "--temperature", "0",
                          "--slot", "0", "--json"))
    assert last["done"] and last["timings"]["predictedN"] == 8
    toks = [int(t) for t in cli(port, "tokenize", "hello").strip("[]\n").split(", ")]
    slots = [json.loads(line) for line in cli(port, "slots").splitlines()]
    assert slots[0]["nTokens"] == len(toks) + 8 and slots[1]["nTokens"] == 0
    assert json.loads(cli(port, "save", "0", "cli-save"))["nSaved"] == len(toks) + 8
    assert json.loads(cli(port, "restore", "1", "cli-save"))["draftRestored"]
    assert json.loads(cli(port, "erase", "0"))["nErased"] == len(toks) + 8
    text = cli(port, "generate", "hello", "--max-tokens", "8", "--temperature", "0")
    with InferenceClient(f"127.0.0.1:{port}") as c:
        expected = c.detokenize(ref.generate(toks, 8))
    assert text == "hello" + expected
    r = subprocess.run([sys.executable, "-m", "inference_svc.client", "--addr",
                        f"127.0.0.1:{port}", "restore", "0", "../x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr
    assert "generate" in proc.messages() and "slot saved" in proc.messages()


@pytest.mark.parametrize("proc", ["5", "0.1"], indirect=True)
def test_sigterm_stops_gracefully(proc: Proc) -> None:
    """Grace 5 s: the running generation finishes. Grace 0.1 s with a slow model and 480
    tokens to go: it is cut at a step boundary and gets UNAVAILABLE. Either way the
    process exits 0."""
    outcome: dict[str, object] = {}
    started = threading.Event()

    def long_generation() -> None:
        with InferenceClient(f"127.0.0.1:{proc.port}") as c:
            got = 0
            try:
                n = 240 if proc.grace == "5" else 480
                req = make_request("hello", max_tokens=n, speculative=False)
                for r in c.generate_stream(req):
                    started.set()
                    got += len(r.tokens)
                    if r.done:
                        outcome["done"] = got
            except grpc.RpcError as exc:
                outcome["error"] = exc.code()

    t = threading.Thread(target=long_generation)
    t.start()
    assert started.wait(10)
    t0 = time.monotonic()
    proc.p.send_signal(signal.SIGTERM)
    assert proc.p.wait(20) == 0
    assert time.monotonic() - t0 < 10
    t.join(10)
    if proc.grace == "5":
        assert outcome == {"done": 240}
    else:
        assert outcome == {"error": grpc.StatusCode.UNAVAILABLE}
    msgs = proc.messages()
    assert "signal" in msgs and "stopping" in msgs and msgs[-1] == "stopped"


def run_to_exit(*args: str) -> tuple[int, list[dict[str, object]]]:
    r = subprocess.run([sys.executable, "-m", "inference_svc", "--host", "127.0.0.1", "--port",
                        "0", "--log-format", "json", "--threads", "1", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, [json.loads(line) for line in r.stderr.splitlines()]


def test_unsupported_model_is_refused_before_listening(tmp_path: Path) -> None:
    """The architecture comes from the file's header, before the port is opened: one
    error line, nothing else started or claimed."""
    from tests.factory import Shape, write_model

    bad = tmp_path / "gpt2.gguf"
    write_model(bad, Shape(n_vocab=300, n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=96),
                arch="gpt2")
    rc, lines = run_to_exit("--model", str(bad), "--draft", "none")
    assert rc == 1
    assert [r["msg"] for r in lines] == ["cannot start"]
    assert lines[0]["error"] == (f"{bad}: architecture 'gpt2' is not supported "
                                 f"(supported: llama, gemma3)")
    good, _ = model_pair(tmp_path, "draft-check")
    rc, lines = run_to_exit("--model", str(good), "--draft", str(bad))  # the draft too
    assert rc == 1 and [r["msg"] for r in lines] == ["cannot start"]
    assert "architecture 'gpt2' is not supported" in str(lines[0]["error"])


def test_a_draft_of_another_vocabulary_is_refused_at_start(tmp_path: Path) -> None:
    """A gemma3 target (no draft exists for it) with a draft whose vocabulary differs:
    the service does not start, and its one error line names both vocabularies."""
    from tests.factory import Shape, write_model

    target = tmp_path / "gemma3.gguf"
    write_model(target, Shape(n_vocab=300, n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
                              n_ff=96, arch="gemma3", head_dim=32, n_swa=8, tied=True))
    draft = tmp_path / "draft.gguf"
    write_model(draft, Shape(n_vocab=310, n_embd=32, n_layer=1, n_head=2, n_head_kv=2,
                             n_ff=48))
    rc, lines = run_to_exit("--model", str(target), "--draft", str(draft))
    assert rc == 1
    assert lines[-1]["msg"] == "cannot start"
    assert "the draft's vocabulary (310 tokens) differs from the target's (300" in str(
        lines[-1]["error"])


def test_a_model_failing_to_load_ends_with_the_error(tmp_path: Path) -> None:
    """A problem found while loading (after the port opened): the stop claims no
    auto-save, and the last line is the error."""
    target, _ = model_pair(tmp_path, "cut")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(target.read_bytes()[:-1000])
    rc, lines = run_to_exit("--model", str(cut), "--draft", "none", "--slot-save-path",
                            str(tmp_path / "slots"))
    assert rc == 1
    msgs = [r["msg"] for r in lines]
    assert msgs == ["listening", "stopping", "stopped", "cannot start"]
    assert lines[2]["auto_save_ok"] is None
    assert "not a readable GGUF file" in str(lines[3]["error"])
