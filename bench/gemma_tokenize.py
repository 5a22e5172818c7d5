"""Gemma tokenizer on a long prompt: how long it keeps other Python threads (the engine,
the gRPC handlers) from running, the merge loop in the core (the product's path) against
the same loop in Python (the tokenizer before it moved into the core).

    .venv/bin/python bench/gemma_tokenize.py [--model models/gemma-3-270m-q4_k_m.gguf]
                                             [--kbytes 100] [--reps 5]

The text is a fixed mix of code, prose, whitespace runs, emoji and CJK repeated to
--kbytes KB. In each repetition, in alternating order, each path encodes it (both give
the same ids, checked) while a probe thread wakes every 0.5 ms: the probe's longest gap
between two wake-ups is how long it waited at most (the GIL hold, plus the machine's own
scheduling delays: the idle line is the probe's gaps while the main thread sleeps), and
its wake-ups per second how much another thread runs meanwhile; both depend on the
machine's load. Load-independent: the encoding thread's CPU seconds, of which those in
the core's merge call (which runs without the GIL); the rest is CPU time under the GIL.
Python itself hands the GIL over every sys.getswitchinterval() (5 ms) while it runs
bytecode, so no path holds it longer than that plus its longest single C call.
Reported: per path the medians over the repetitions. The last line printed is one JSON
object."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Tokenizer, load_gguf  # noqa: E402
from tests.test_gemma3_tokenizer import reference_bpe  # noqa: E402

BASE = ("def fibonacci(n):\n    if n < 2:\n        return n  # 🙂 naïve   spaces\n"
        "\tHello, world! Ünïcödé 日本語 text 👨‍👩‍👧 and more prose about caches.\n")
PROBE_S = 0.0005


def probed(fn: Callable[[], object], nogil: list[float]) -> dict[str, float]:
    """fn's wall and CPU time (of which nogil[0] seconds without the GIL), and the probe
    thread's longest gap and wake-up rate meanwhile."""
    gaps: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(PROBE_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.02)
    gaps.clear()
    nogil[0] = 0.0
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    n = len(gaps)
    stop.set()
    th.join()
    return {"seconds": dt, "cpu_s": cpu, "cpu_without_gil_s": nogil[0],
            "cpu_with_gil_s": cpu - nogil[0], "max_gap_ms": 1e3 * max(gaps[:n] or [dt]),
            "probe_wakeups_per_s": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--kbytes", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer(load_gguf(args.model).tokenizer)
    spm = tok._spm
    assert spm is not None, "not a SentencePiece ('llama') tokenizer"
    size = args.kbytes * 1000
    text = BASE * (size // len(BASE.encode()) + 1)
    while len(text.encode()) > size:
        text = text[:-1]
    native_bpe = spm._bpe
    nogil = [0.0]

    def timed_native(s: str) -> list[int]:
        c0 = time.thread_time()
        try:
            return native_bpe(s)
        finally:
            nogil[0] += time.thread_time() - c0

    def python_bpe(s: str) -> list[int]:
        return reference_bpe(spm, s)

    def encode_with(bpe: Callable[[str], list[int]]) -> Callable[[], list[int]]:
        def run() -> list[int]:
            spm._bpe = bpe  # type: ignore[method-assign]
            try:
                return tok.encode(text)
            finally:
                spm._bpe = native_bpe  # type: ignore[method-assign]
        return run

    paths = {"native": encode_with(timed_native), "python": encode_with(python_bpe)}
    ids = {name: fn() for name, fn in paths.items()}  # warm-up, and the same ids
    assert ids["native"] == ids["python"], "the two paths give different ids"
    runs: dict[str, list[dict[str, float]]] = {"idle": [], "native": [], "python": []}
    for rep in range(args.reps):
        order = ["native", "python"] if rep % 2 == 0 else ["python", "native"]
        runs["idle"].append(probed(lambda: time.sleep(0.3), nogil))
        for name in order:
            runs[name].append(probed(paths[name], nogil))
    out: dict[str, object] = {"bench": "gemma_tokenize", "text_bytes": len(text.encode()),
                              "n_ids": len(ids["native"]), "reps": args.reps,
                              "switch_interval_ms": 1e3 * sys.getswitchinterval()}
    for name, rs in runs.items():
        out[name] = {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
        print(f"{name:7s}", out[name])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
