"""Real inference-service processes for the restart-resume tests: start with flags,
wait for SERVING, talk gRPC, stop with a real signal; and a multi-turn session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference_svc.client import InferenceClient, make_request

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "models" / "target.gguf"
DRAFT = ROOT / "models" / "draft.gguf"


class InferenceProcess:
    """`python -m inference_svc` on 127.0.0.1 with a free port, JSON logs collected."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 120.0) -> None:
        argv = [sys.executable, "-m", "inference_svc", "--host", "127.0.0.1", "--port", "0",
                "--log-format", "json", *args]
        self.lines: list[dict[str, Any]] = []
        self._serving = threading.Event()
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = 0
        if not self._serving.wait(start_timeout) or not self.has("serving"):
            self.kill()
            raise RuntimeError(f"the inference service did not start: {self.lines[-10:]}")
        self.port = int(next(r["port"] for r in self.lines if r.get("msg") == "listening"))
        self.client = InferenceClient(f"127.0.0.1:{self.port}", timeout=300)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"msg": "raw", "line": line.rstrip("\n")}
            self.lines.append(rec)
            if rec.get("msg") in ("serving", "cannot start"):
                self._serving.set()
        self._serving.set()

    def has(self, msg: str) -> bool:
        return any(r.get("msg") == msg for r in self.lines)

    def records(self, msg: str) -> list[dict[str, Any]]:
        return [r for r in self.lines if r.get("msg") == msg]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        self.client.close()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> InferenceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close() if self.port else None
        self.kill()


@dataclass
class Turn:
    tokens: list[int]
    timings: Any


@dataclass
class Session:
    """A conversation on one slot: each turn sends everything so far plus new tokens."""

    slot: int = 0
    max_tokens: int = 100
    n_max: int = 8
    p_min: float = 0.0  # explicit: the tests do not depend on the server's defaults
    history: list[int] = field(default_factory=list)

    def turn(self, proc: InferenceProcess, new: list[int]) -> Turn:
        req = make_request(self.history + new, max_tokens=self.max_tokens, id_slot=self.slot,
                           temperature=0.0, speculative=True, n_max=self.n_max,
                           p_min=self.p_min)
        out: list[int] = []
        last = None
        for resp in proc.client.generate_stream(req):
            out += list(resp.tokens)
            last = resp
        assert last is not None and last.done
        self.history += new + out
        return Turn(out, last.timings)


@dataclass
class TurnResult:
    tokens: list[int]
    timings: Any  # the last GenerateResponse's Timings
    ttft_ms: float  # client side: request sent -> first streamed token
    total_ms: float


def timed_turn(proc: InferenceProcess, prompt: list[int], max_tokens: int, n_max: int,
               p_min: float, slot: int = 0) -> TurnResult:
    """One greedy speculative request, timed by the client (demo and benchmark)."""
    req = make_request(prompt, max_tokens=max_tokens, id_slot=slot, temperature=0.0,
                       speculative=True, n_max=n_max, p_min=p_min)
    out: list[int] = []
    first = last = None
    t0 = time.perf_counter()
    for resp in proc.client.generate_stream(req):
        if first is None and resp.tokens:
            first = time.perf_counter()
        out += list(resp.tokens)
        last = resp
    end = time.perf_counter()
    if last is None or not last.done:
        raise RuntimeError("the generation stream ended without its last response")
    return TurnResult(out, last.timings, 1e3 * ((first or end) - t0), 1e3 * (end - t0))


def source_tokens(proc: InferenceProcess, n: int) -> list[int]:
    """n tokens of real Python text (this repository's own sources, a fixed order)."""
    text = "".join(p.read_text() for p in sorted((ROOT / "inference_svc").glob("*.py")))
    text += "".join(p.read_text() for p in sorted((ROOT / "snapshot_svc").glob("*.py")))
    toks = proc.client.tokenize(text)
    assert len(toks) >= n, len(toks)
    return toks[:n]


def wait_until(pred: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        time.sleep(0.05)
