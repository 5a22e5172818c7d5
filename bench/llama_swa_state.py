"""llama.cpp's side of bench/gemma_session.py: the same session in llama-cpp-python with
`swa_full=True` (every position of the sliding-window layers kept, the only mode in which
llama.cpp can extend a restored Gemma 3 slot), its sequence state saved as llama-server's
slot save does (llama_state_seq_get_data), restored into a cleared context and continued
with the same new tokens.

    /path/to/llvenv/bin/python bench/llama_swa_state.py --model M --tokens T.json
                                                        [--threads 2] [--reps 3]

T.json: {"session": [ids], "new": [ids]}. Run by gemma_session.py with --llama-python;
never imported (llama_cpp is not a project dependency). Per repetition, alternating:
restored (clear, set the saved state, decode the new tokens) and cold (clear, decode the
session and the new tokens); TTFT = until the logits of the last new token. The last
line printed is one JSON object."""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    toks = json.loads(a.tokens.read_text())
    session, new = toks["session"], toks["new"]
    llm = Llama(model_path=str(a.model), n_ctx=4096, n_batch=512, n_threads=a.threads,
                n_threads_batch=a.threads, swa_full=True, verbose=False)
    ctx = llm._ctx.ctx
    mem = llama_cpp.llama_get_memory(ctx)

    def clear() -> None:
        llama_cpp.llama_memory_clear(mem, True)
        llm.reset()

    def last_argmax() -> int:
        """The greedy pick after the last decoded token (its logits, read in place)."""
        row = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())

    clear()
    llm.eval(session)
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    got = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    assert got == size, (got, size)
    runs = []
    for rep in range(a.reps):
        row: dict[str, float] = {}
        for kind in (("restored", "cold") if rep % 2 == 0 else ("cold", "restored")):
            clear()
            t0 = time.perf_counter()
            if kind == "restored":
                read = llama_cpp.llama_state_seq_set_data(ctx, buf, size, 0)
                row["restore_ms"] = (time.perf_counter() - t0) * 1e3
                assert read == size, (read, size)
                llm.input_ids[:len(session)] = session
                llm.n_tokens = len(session)
                llm.eval(new)
            else:
                llm.eval(session + new)
            row[kind + "_ttft_ms"] = (time.perf_counter() - t0) * 1e3
            row[kind + "_next"] = last_argmax()
        runs.append(row)
    same = all(r["restored_next"] == r["cold_next"] for r in runs)

    def med(k: str) -> float:
        return round(statistics.median(r[k] for r in runs), 1)

    print(json.dumps({"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__,
                      "swa_full": True, "state_bytes": size, "restore_ms": med("restore_ms"),
                      "ttft_ms": {"restored": med("restored_ttft_ms"),
                                  "cold": med("cold_ttft_ms")},
                      "restored_next_token_equals_cold": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
