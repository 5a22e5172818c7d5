"""A draft catch-up next to a decoding stream: the decoding stream's inter-token gaps.

    .venv/bin/python bench/catch_up.py [--context 4000] [--decode 300] [--reps 3]
                                       [--prompt 3] [--batch 512] [--batch-shared 64]
                                       [--threads 1] [--model PATH] [--draft PATH]

The bundled toy models by default (models/target.gguf + models/draft.gguf), an
in-process engine with two slots and --ctx 4096, the path a restored slot takes: slot 1 holds a
--context-token session saved to a local store, its sidecar removed, and restored
with the 'reprefill' policy (the draft starts empty). Slot 0 decodes --decode
tokens (greedy, target only: one token per engine round). Once it has emitted 20
tokens, a speculative request on slot 1 (the session plus --prompt tokens, 4 new
tokens) arrives, so its draft must catch up the whole session while slot 0 decodes;
then its prompt and its decode steps run at the session's long context.

Three modes, interleaved in every repetition:
- bounded: the engine as shipped: next to the decoding slot the catch-up runs
           chunks sized to half a decode step (at most --batch-shared tokens);
- whole:   the catch-up in one unit (the draft_catch_up call asked for the whole
           lag), the behaviour before the catch-up was bounded;
- alone:   no catch-up request at all: the decoding stream's own spread on this
           machine, the floor the other two are read against.

Per mode (medians over the repetitions): the median, p99 and largest of slot 0's
inter-token gaps over the whole stream, over `median` (slot 0's median gap of the
run); the same p99 and largest over the gaps *during* the catch-up (from the gap
its first unit ends in to the one its last unit ends in; alone: the same gaps as
the bounded run of its repetition) and *after* it (slot 1's prompt, decode steps
and end, then slot 0 alone); the number of catch-up units, the longest one and
the longest one that ran while slot 0 was decoding. For the bounded mode, each
repetition prints slot 0's four largest gaps (index, ms, before, during or after
the catch-up) with the decoder calls that ended in each (catch-up, prompt chunk, prompt,
step of the slots, commit) and their ms, then the ms outside those calls (Python,
the GIL, the reader's wake-up).
The next-to-last line states the figures the target is read from (p99 / median
during the catch-up <= 2, next to the same ratio of the stream alone); the last
line printed is one JSON object.
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
from inference_svc.core.params import SamplingParams, SpecParams  # noqa: E402
from inference_svc.engine.executor import Engine, GenJob  # noqa: E402
from inference_svc.engine.slot_owner import SlotOwner  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.storage.slots import SlotManager  # noqa: E402
from inference_svc.storage.store import LocalStore  # noqa: E402
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


UNITS = {"draft_catch_up": "catch-up", "prefill_chunk": "prompt chunk", "prefill": "prompt",
         "step_batch": "step", "commit": "commit"}  # the decoder calls each unit makes


def window_stats(gaps: list[float], lo: int, hi: int, med: float) -> dict[str, float]:
    """p99 and largest of gaps[lo:hi] over `med` (the whole stream's median); 0 when
    the range is empty (slot 0 ended first)."""
    w = gaps[lo:hi] or [0.0]
    return {"n_gaps": hi - lo, "p99_ms": pct(w, 0.99), "max_ms": max(w),
            "p99_over_median": pct(w, 0.99) / med, "max_over_median": max(w) / med}


def run_once(engine: Engine, slots: SlotManager, session: list[int], n_decode: int,
             n_prompt: int, mode: str) -> dict[str, Any]:
    whole = mode == "whole"
    r = slots.restore(1, "session")
    assert r.draft_policy.label == "reprefill", r
    dec = engine.owner
    units: list[tuple[float, float, str]] = []  # (start, end, what) of every decoder call
    real = {name: getattr(dec, name) for name in UNITS}

    def timed(name: str) -> Any:
        fn = real[name]

        def call(*args: Any, **kw: Any) -> Any:
            if whole and name == "draft_catch_up":
                args = (args[0], 1 << 30)  # the whole lag in one unit
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            slot = args[0] if isinstance(args[0], int) else ",".join(map(str, args[0]))
            units.append((t0, time.perf_counter(), f"{UNITS[name]} {slot}"))
            return out
        return call

    for name in UNITS:
        setattr(dec, name, timed(name))
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
            b = engine.generate(params(session + list(range(5, 5 + n_prompt)), 1, 4, SPEC))
            got += drain(a, stamps)
            drain(b)
    finally:
        for name, fn in real.items():
            setattr(dec, name, fn)
    gaps = [1e3 * (y - x) for x, y in zip(stamps, stamps[1:], strict=False)]
    med, p99 = statistics.median(gaps), pct(gaps, 0.99)
    catch = [u for u in units if u[2].startswith("catch-up")]
    shared = [u for u in catch if u[1] < stamps[-1]]  # while slot 0 was decoding
    # the gaps of slot 0 in which catch-up units ended: from the first to the last
    # (0, 0: no catch-up)
    lo = hi = 0
    if catch:
        lo = next(i for i in range(len(gaps)) if stamps[i + 1] >= catch[0][1])
        hi = next((i for i in range(len(gaps)) if stamps[i + 1] >= catch[-1][1]), len(gaps)) + 1

    def ran(i: int) -> list[tuple[str, float]]:
        # the units that ended between the two tokens
        return [(w, round(1e3 * (e - s), 1)) for s, e, w in units
                if stamps[i] < e <= stamps[i + 1]]

    def phase(i: int) -> str:
        return "before" if i < lo else "during" if i < hi else "after"

    largest = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:4]
    return {"median_ms": med, "p99_ms": p99, "max_ms": max(gaps), "p99_over_median": p99 / med,
            "max_over_median": max(gaps) / med, "n_gaps": len(gaps),
            "catch_up_units": len(catch),
            "longest_unit_ms": max((1e3 * (e - s) for s, e, _ in catch), default=0.0),
            "longest_shared_unit_ms": max((1e3 * (e - s) for s, e, _ in shared), default=0.0),
            "tokens": got, "gaps": gaps, "window": (lo, hi),
            "largest": [(i, round(gaps[i], 1), phase(i), ran(i),
                         round(gaps[i] - sum(ms for _, ms in ran(i)), 1))
                        for i in sorted(largest)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--decode", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=3)
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
    engine = Engine(cfg, SlotOwner(cfg, target, draft), Metrics())
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
            runs = {mode: run_once(engine, slots, session, args.decode, args.prompt, mode)
                    for mode in modes[rep % 3:] + modes[:rep % 3]}
            windows = {mode: runs[mode].pop("window") for mode in modes}
            windows["alone"] = windows["bounded"]  # the same gaps of slot 0 as the catch-up's
            for mode in modes:
                res = runs[mode]
                toks = res.pop("tokens")
                assert tokens is None or toks == tokens, "the decoding stream changed"
                tokens = toks
                lo, hi = windows[mode]
                gaps, med = res.pop("gaps"), res["median_ms"]
                for k, v in window_stats(gaps, lo, hi, med).items():
                    res["during_" + k] = v
                for k, v in window_stats(gaps, hi, len(gaps), med).items():
                    res["after_" + k] = v
                largest = res.pop("largest")
                results[mode].append(res)
                print(mode, {k: round(v, 3) for k, v in res.items()}, flush=True)
                if mode == "bounded":  # what ran in slot 0's largest gaps
                    for row in largest:
                        print("   gap", *row, flush=True)
    engine.close()
    summary: dict[str, Any] = {"bench": "catch_up", "context": args.context,
                               "decode": args.decode, "batch": args.batch,
                               "batch_shared": args.batch_shared, "reps": args.reps,
                               "prompt": args.prompt,
                               "threads": args.threads, "model": args.model.name,
                               "draft": args.draft.name}
    for mode, rs in results.items():
        summary[mode] = {k: round(statistics.median(r[k] for r in rs), 3)
                         for k in ("median_ms", "p99_ms", "max_ms", "p99_over_median",
                                   "max_over_median", "catch_up_units", "longest_unit_ms",
                                   "longest_shared_unit_ms", "during_n_gaps",
                                   "during_p99_over_median", "during_max_over_median",
                                   "after_n_gaps", "after_p99_over_median",
                                   "after_max_over_median")}
    b, alone = summary["bounded"], summary["alone"]
    print(f"slot 0's gaps during the catch-up: p99 / median {b['during_p99_over_median']} "
          f"(alone, the same gaps: {alone['during_p99_over_median']}; target <= 2); "
          f"whole stream {b['p99_over_median']} (alone {alone['p99_over_median']}); "
          f"after the catch-up {b['after_p99_over_median']} "
          f"(alone {alone['after_p99_over_median']})", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
