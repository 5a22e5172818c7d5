"""Reading a slot's state out of the core and encoding its slot files, against the C
call alone.

    .venv/bin/python bench/slot_state.py [--tokens 4000] [--reps 15]

Bundled pair (models/target.gguf, models/draft.gguf), one slot of --tokens tokens in
both. Interleaved in every repetition:
- c_call:     ws_spec_slot_state_get into buffers allocated and touched beforehand
              (the core's own copy, nothing else);
- capture:    what a save runs on the engine thread: SpecDecoder.slot_state writing
              into fresh SlotFileBuffers (the files' buffers);
- get_state:  Context.get_state (the target's state alone, into a fresh buffer);
- encode:     capture, then SlotFileBuffers.encode (headers and SHA-256 digests in
              place): the bytes a store is given;
- old_encode: capture into fresh buffers, then the files joined from their parts
              (encode_target / encode_draft, the previous save path).
Each way's bytes are checked equal. Reported: the median time of each and the median
of the per-repetition ratios to c_call (get_state: to the target's part of c_call,
timed alone in the same repetition); then, once, the peak memory (tracemalloc, numpy
buffers included) that encode and old_encode allocate and that a restore of the files
from a local store allocates, over the files' size. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model, binding  # noqa: E402
from inference_svc.core.speculative import SpecDecoder  # noqa: E402
from inference_svc.storage import slotfile  # noqa: E402
from inference_svc.storage.snapshots import (  # noqa: E402
    SlotFileBuffers,
    context_spec,
    prepare_restore,
)
from inference_svc.storage.store import LocalStore  # noqa: E402


def peak_over(fn: Callable[[], object], size: int) -> float:
    """The most memory fn held allocated at once, over `size`."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
        del out
    finally:
        tracemalloc.stop()
    return round(peak / size, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ffi = binding.ffi
    with Model.load(ROOT / "models/target.gguf") as tm, \
            Model.load(ROOT / "models/draft.gguf") as dm, \
            Context(tm, n_slots=2, n_ctx=args.tokens, n_threads=1) as tc, \
            Context(dm, n_slots=2, n_ctx=args.tokens, n_threads=1) as dc, \
            SpecDecoder(tc, dc) as dec:
        toks = [(37 * k + 11) % (tm.n_vocab - 1) + 1 for k in range(args.tokens)]
        for i in range(0, len(toks), 512):
            dec.prefill_chunk(0, toks[i:i + 512])
        tsize, dsize = binding.spec_slot_state_prepare(dec.handle, 0)
        tpre, dpre = np.ones(tsize, dtype=np.uint8), np.ones(dsize, dtype=np.uint8)
        tspec, dspec = context_spec(tc), context_spec(dc)

        def c_call() -> tuple[memoryview, memoryview]:
            tn, dn = binding.spec_slot_state_get(dec.handle, 0, ffi.from_buffer(tpre), tsize,
                                                 ffi.from_buffer(dpre), dsize)
            return memoryview(tpre)[:tn], memoryview(dpre)[:dn]

        def c_target() -> memoryview:
            n = binding.slot_state_get(tc.handle, 0, ffi.from_buffer(tpre), tsize)
            return memoryview(tpre)[:n]

        def capture() -> tuple[memoryview, memoryview | None]:
            files = SlotFileBuffers(tspec)
            return dec.slot_state(0, files.target, files.draft)

        def encode() -> tuple[memoryview, memoryview | None]:
            files = SlotFileBuffers(tspec)
            t, d = dec.slot_state(0, files.target, files.draft)
            enc = files.encode(t, d, dspec)
            return enc.target, enc.draft

        def old_encode() -> tuple[bytes, bytes]:
            t, d = dec.slot_state(0)
            tbytes = slotfile.encode_target(slotfile.target_from_core(t, tspec))
            assert d is not None
            return tbytes, slotfile.encode_draft(
                slotfile.draft_from_core(d, slotfile.digest(tbytes), dspec))

        ref = tuple(bytes(x) for x in c_call())
        ref_files = tuple(bytes(x) for x in old_encode())

        def same(out: object, want: tuple[bytes, ...]) -> bool:
            return tuple(bytes(x) for x in out) == want  # type: ignore[attr-defined]

        checks: dict[str, Callable[[object], bool]] = {
            "c_call": lambda o: same(o, ref), "capture": lambda o: same(o, ref),
            "get_state": lambda o: bytes(o) == ref[0],  # type: ignore[call-overload]
            "c_target": lambda o: bytes(o) == ref[0],  # type: ignore[call-overload]
            "encode": lambda o: same(o, ref_files), "old_encode": lambda o: same(o, ref_files)}
        ways: dict[str, Callable[[], object]] = {
            "c_call": c_call, "capture": capture, "get_state": lambda: tc.get_state(0),
            "c_target": c_target, "encode": encode, "old_encode": old_encode}
        times: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        for rep in range(args.reps + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                out = ways[name]()
                dt = time.perf_counter() - t0
                assert checks[name](out), name
                del out
                if rep:  # the first round warms up
                    times[name].append(1e3 * dt)
        file_bytes = sum(len(x) for x in ref_files)
        peaks = {"encode_peak_over_files": peak_over(encode, file_bytes),
                 "old_encode_peak_over_files": peak_over(old_encode, file_bytes)}
        with tempfile.TemporaryDirectory() as tmp:
            store = LocalStore(Path(tmp))
            store.save("s", *ref_files)

            def restore() -> None:
                p = prepare_restore(store, "s", tspec, dspec)
                assert p.draft_state is not None, p.draft_note
                assert dec.set_slot_state(1, p.target_parts, p.draft_state, 0) == (True, "")

            peaks["restore_peak_over_files"] = peak_over(restore, file_bytes)
            assert dec.tokens(1) == dec.tokens(0)
    res: dict[str, object] = {"bench": "slot_state", "tokens": args.tokens,
                              "target_state_bytes": tsize, "draft_state_bytes": dsize,
                              "file_bytes": file_bytes, "reps": args.reps}
    for name, ts in times.items():
        base = times["c_target" if name == "get_state" else "c_call"]
        res[f"{name}_ms"] = round(statistics.median(ts), 3)
        if name not in ("c_call", "c_target"):
            res[f"{name}_over_c_call"] = round(statistics.median(
                t / c for t, c in zip(ts, base, strict=True)), 3)
    res.update(peaks)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
