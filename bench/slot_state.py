"""Reading a slot's state out of the core: Context.get_state against the C call alone.

    .venv/bin/python bench/slot_state.py [--tokens 4000] [--reps 15]

Bundled target model (models/target.gguf), one slot of --tokens tokens. Three
ways to read the same state, interleaved in every repetition:
- c_call:    ws_slot_state_get into a buffer allocated and touched beforehand
             (the core's own copy, nothing else);
- get_state: Context.get_state as shipped (a fresh buffer, the core writes it,
             a read-only view of it is returned);
- old:       the previous Context.get_state (a zero-filled bytearray, the core
             writes it, then bytes(buf[:n]) copies it).
Each read's bytes are checked equal. Reported: the median time of each and the
median of the per-repetition ratios to c_call. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model, binding  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ffi = binding.ffi
    with Model.load(ROOT / "models/target.gguf") as m, \
            Context(m, n_slots=1, n_ctx=args.tokens, n_threads=1) as ctx:
        toks = [(37 * k + 11) % (m.n_vocab - 1) + 1 for k in range(args.tokens)]
        ctx.decode(0, toks)
        size = ctx.state_size(0)
        pre = np.ones(size, dtype=np.uint8)

        def c_call() -> memoryview:
            n = binding.slot_state_get(ctx.handle, 0, ffi.from_buffer(pre), size)
            return memoryview(pre)[:n]

        def old() -> bytes:
            buf = bytearray(size)
            n = binding.slot_state_get(ctx.handle, 0, ffi.from_buffer(buf), size)
            return bytes(buf[:n])

        ways = {"c_call": c_call, "get_state": lambda: ctx.get_state(0), "old": old}
        ref = bytes(c_call())
        times: dict[str, list[float]] = {k: [] for k in ways}
        for rep in range(args.reps + 1):
            names = list(ways)[rep % 3:] + list(ways)[:rep % 3]
            for name in names:
                t0 = time.perf_counter()
                out = ways[name]()
                dt = time.perf_counter() - t0
                assert out == ref, name
                del out
                if rep:  # the first round warms up
                    times[name].append(1e3 * dt)
    res = {"bench": "slot_state", "tokens": args.tokens, "state_bytes": size,
           "reps": args.reps}
    for name, ts in times.items():
        res[f"{name}_ms"] = round(statistics.median(ts), 3)
        res[f"{name}_over_c_call"] = round(statistics.median(
            t / c for t, c in zip(ts, times["c_call"], strict=True)), 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
