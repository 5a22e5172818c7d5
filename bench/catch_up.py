"""A draft catch-up next to a decoding stream: the decoding stream's inter-token gaps.

    .venv/bin/python bench/catch_up.py [--context 4000] [--decode 300] [--reps 3]
                                       [--batch 512] [--batch-shared 64] [--threads 1]
                                       [--model PATH] [--draft PATH]

The bundled toy models by default (models/target.gguf + models/draft.gguf), an
in-process engine with two slots and --ctx 4096, the path a restored slot takes: slot 1 holds a
--context-token session saved to a local store, its sidecar removed, and restored
with the 'reprefill' policy (the draft starts empty). Slot 0 decodes --decode
tokens (greedy, target only: one token per engine round). Once it has emitted 20
tokens, a speculative request on slot 1 (the session plus 3 tokens) arrives, so
its draft must catch up the whole session while slot 0 decodes.

Two modes, interleaved in every repetition:
- bounded: the engine as shipped: next to the decoding slot the catch-up runs
           chunks sized to half a decode step (at most --batch-shared tokens);
- whole:   the catch-up in one unit (the draft_catch_up call asked for the whole
           lag), the behaviour before the catch-up was bounded;
- alone:   no catch-up request at all: the decoding stream's own spread on this
           machine, the floor the other two are read against.

Per mode (medians over the repetitions): the median, p99 and largest of slot 0's
inter-token gaps over the whole stream, p99 / median and largest / median, the
number of catch-up units, the longest one and the longest one that ran while
slot 0 was decoding. Next to slot 0 a bounded catch-up holds the engine for one
unit of about half a decode step, so slot 0's gaps stay near 1.5 steps.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.config import Config  # noqa: E402
from inference_svc.core import Model  # noqa: E402
from inference_svc.core.speculative import SamplingParams, SpecParams  # noqa: E402
from inference_svc.engine import Engine, GenJob  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.slots import SlotManager  # noqa: E402
from inference_svc.store import LocalStore  # noqa: E402
from inference_svc.types import Chunk, Finished, GenerateParams  # noqa: E402

GREEDY = SamplingParams()
SPEC = SpecParams(n_max=8)


def params(prompt: list[int], slot: int, n: int, spec: SpecParams | None) -> GenerateParams:
    return GenerateParams(tuple(prompt), n, slot, True, GREEDY, None, spec)


def drain(job: GenJob, stamps: list[float] | None = None) -> list[int]:
    """The job's tokens; `stamps`: the arrival time of each token."""
    toks: list[int] = []
    while True:
        item = job.out.get(timeout=600)
        if isinstance(item, BaseException):
            raise item
        chunk = item.last if isinstance(item, Finished) else item
        if isinstance(chunk, Chunk):
            now = time.perf_counter()
            toks += chunk.tokens
            if stamps is not None:
                stamps += [now] * len(chunk.tokens)
        if isinstance(item, Finished):
            return toks


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_once(engine: Engine, slots: SlotManager, session: list[int], n_decode: int,
             mode: str) -> dict[str, Any]:
    whole = mode == "whole"
    r = slots.restore(1, "session")
    assert r.draft_policy.label == "reprefill", r
    dec = engine.dec
    real = dec.draft_catch_up
    units: list[float] = []  # the duration of each catch-up unit, ms
    shared: list[float] = []  # those that ran while slot 0 was decoding

    def timed(slot: int, n: int) -> tuple[int, int]:
        t0 = time.perf_counter()
        out = real(slot, 1 << 30 if whole else n)
        units.append(1e3 * (time.perf_counter() - t0))
        if not a.ended.is_set():
            shared.append(units[-1])
        return out

    dec.draft_catch_up = timed  # type: ignore[method-assign]
    try:
        slots.erase(0)
        a = engine.generate(params([11, 12, 13], 0, n_decode, None))
        stamps: list[float] = []
        got: list[int] = []
        while len(got) < 20:  # slot 0 decodes before the catch-up arrives
            item = a.out.get(timeout=600)
            assert isinstance(item, Chunk), item
            got += item.tokens
            stamps += [time.perf_counter()] * len(item.tokens)
        if mode == "alone":  # no catch-up: the decoding stream's own spread
            got += drain(a, stamps)
        else:
            b = engine.generate(params(session + [5, 6, 7], 1, 4, SPEC))
            got += drain(a, stamps)
            drain(b)
    finally:
        dec.draft_catch_up = real  # type: ignore[method-assign]
    gaps = [1e3 * (y - x) for x, y in zip(stamps, stamps[1:], strict=False)]
    med, p99 = statistics.median(gaps), pct(gaps, 0.99)
    return {"median_ms": med, "p99_ms": p99, "max_ms": max(gaps), "p99_over_median": p99 / med,
            "max_over_median": max(gaps) / med, "n_gaps": len(gaps),
            "catch_up_units": len(units), "longest_unit_ms": max(units, default=0.0),
            "longest_shared_unit_ms": max(shared, default=0.0), "tokens": got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--decode", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--batch-shared", type=int, default=Config.batch_shared)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=ROOT / "models/target.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/draft.gguf")
    args = ap.parse_args()
    target, draft = Model.load(args.model), Model.load(args.draft)
    cfg = Config(model=args.model, draft=args.draft, slots=2, ctx=4096, batch=args.batch,
                 batch_shared=args.batch_shared, threads=args.threads,
                 draft_threads=args.threads,
                 seed=1, log_level="warning", log_format="text")
    engine = Engine(cfg, target, draft, Metrics())
    modes = ("bounded", "whole", "alone")
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(Path(d))
        slots = SlotManager(engine, store, "reprefill", Metrics())
        session = [(37 * k + 11) % (target.n_vocab - 1) + 1 for k in range(args.context)]
        drain(engine.generate(params(session, 1, 1, SPEC)))
        slots.save(1, "session")
        (Path(d) / "session.drft").unlink()
        tokens: list[int] | None = None
        for rep in range(args.reps):
            for mode in modes[rep % 3:] + modes[:rep % 3]:
                res = run_once(engine, slots, session, args.decode, mode)
                toks = res.pop("tokens")
                assert tokens is None or toks == tokens, "the decoding stream changed"
                tokens = toks
                results[mode].append(res)
                print(mode, {k: round(v, 3) for k, v in res.items()}, flush=True)
    engine.close()
    summary: dict[str, Any] = {"bench": "catch_up", "context": args.context,
                               "decode": args.decode, "batch": args.batch,
                               "batch_shared": args.batch_shared, "reps": args.reps,
                               "threads": args.threads, "model": args.model.name,
                               "draft": args.draft.name}
    for mode, rs in results.items():
        summary[mode] = {k: round(statistics.median(r[k] for r in rs), 3)
                         for k in ("median_ms", "p99_ms", "max_ms", "p99_over_median",
                                   "max_over_median", "catch_up_units", "longest_unit_ms",
                                   "longest_shared_unit_ms")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
