"""KV cache type: slot state size and decode speed, f16 against f32.

    .venv/bin/python bench/kv_cache.py [--model PATH] [--state-tokens 2000]
        [--contexts 128,4000] [--decode-tokens 64] [--reps 7] [--threads 2]
        [--no-decode] [--llama-cpp SITE_PACKAGES]

State: a slot holding --state-tokens tokens (random ids, one prefill) in an f32 and
an f16 context: the core's state size and the size of the slot file the service
writes for it (encode_slot, the path SaveSlot takes). With --llama-cpp (a
site-packages directory holding llama-cpp-python, appended to sys.path so this
venv's packages win), llama.cpp's per-sequence state size
(llama_state_seq_get_size) for the same token ids in a context with its default
KV type (F16), and our f16 file size against it.

Decode: for each context length, both contexts are prefilled once to that length,
then the repetitions alternate (f32, f16, f16, f32, ...): truncate back to the
length and decode --decode-tokens tokens one at a time. Medians per type and the
f16/f32 ratio of the medians. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model  # noqa: E402
from inference_svc.snapshots import encode_slot, model_spec  # noqa: E402

KV_TYPES = ("f32", "f16")


def prefill(ctx: Context, tokens: list[int], chunk: int = 512) -> None:
    ctx.clear(0)
    for i in range(0, len(tokens), chunk):
        ctx.decode(0, tokens[i:i + chunk])


def state_sizes(model: Model, tokens: list[int], threads: int) -> dict[str, dict[str, int]]:
    out = {}
    for kv in KV_TYPES:
        with Context(model, n_ctx=len(tokens), n_threads=threads, kv_type=kv) as ctx:
            prefill(ctx, tokens)
            state = ctx.get_state(0)
            slot = encode_slot(state, None, model_spec(ctx), None)
            out[kv] = {"state_bytes": ctx.state_size(0), "slot_file_bytes": len(slot.target),
                       "kv_bytes_per_token": model.kv_bytes_per_token(kv)}
    return out


def llama_cpp_state_size(site: str, path: Path, tokens: list[int], threads: int) -> int:
    """llama.cpp's per-sequence state size of sequence 0 holding `tokens`."""
    sys.path.append(site)
    import llama_cpp  # type: ignore[import-not-found]

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens), n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)
    llm.eval(tokens)
    return int(llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0))


def decode_rates(model: Model, tokens: list[int], n_ctx: int, n_decode: int, reps: int,
                 threads: int) -> dict[str, Any]:
    ctxs = {kv: Context(model, n_ctx=n_ctx + n_decode, n_threads=threads, kv_type=kv)
            for kv in KV_TYPES}
    try:
        for ctx in ctxs.values():
            prefill(ctx, tokens[:n_ctx])
        follow = tokens[n_ctx:n_ctx + n_decode]
        rates: dict[str, list[float]] = {kv: [] for kv in KV_TYPES}
        order = list(KV_TYPES)
        for _ in range(reps + 1):  # the first round warms up and is dropped
            for kv in order:
                ctx = ctxs[kv]
                ctx.truncate(0, n_ctx)
                t0 = time.perf_counter()
                for t in follow:
                    ctx.decode(0, [t])
                rates[kv].append(n_decode / (time.perf_counter() - t0))
            order.reverse()
        med = {kv: statistics.median(r[1:]) for kv, r in rates.items()}
        return {"context": n_ctx, "decode_tps": med, "f16_over_f32": med["f16"] / med["f32"],
                "runs": {kv: [round(x, 1) for x in r[1:]] for kv, r in rates.items()}}
    finally:
        for ctx in ctxs.values():
            ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "target.gguf")
    ap.add_argument("--state-tokens", type=int, default=2000)
    ap.add_argument("--contexts", default="128,4000", help="context lengths for decode")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-decode", action="store_true", help="state sizes only")
    ap.add_argument("--llama-cpp", metavar="SITE_PACKAGES",
                    help="also measure llama.cpp's per-sequence state size")
    a = ap.parse_args()
    model = Model.load(a.model)
    contexts = [int(x) for x in a.contexts.split(",") if x] if not a.no_decode else []
    n_tok = max([a.state_tokens, *(c + a.decode_tokens for c in contexts)])
    tokens = np.random.default_rng(0).integers(0, model.n_vocab, n_tok).tolist()
    result: dict[str, Any] = {"model": a.model.name, "threads": a.threads,
                              "state_tokens": a.state_tokens}
    st = state_sizes(model, tokens[:a.state_tokens], a.threads)
    result["state"] = st
    result["f16_over_f32_state"] = st["f16"]["state_bytes"] / st["f32"]["state_bytes"]
    print(f"state of {a.state_tokens} tokens: f32 {st['f32']['state_bytes'] / 1e6:.2f} MB, "
          f"f16 {st['f16']['state_bytes'] / 1e6:.2f} MB (slot file "
          f"{st['f16']['slot_file_bytes'] / 1e6:.2f} MB)")
    if a.llama_cpp:
        ll = llama_cpp_state_size(a.llama_cpp, a.model, tokens[:a.state_tokens], a.threads)
        result["llama_cpp_state_bytes"] = ll
        result["f16_slot_file_over_llama_cpp"] = st["f16"]["slot_file_bytes"] / ll
        print(f"llama.cpp per-sequence state: {ll / 1e6:.2f} MB; our f16 slot file / "
              f"llama.cpp: {result['f16_slot_file_over_llama_cpp']:.3f}")
    result["decode"] = []
    for n_ctx in contexts:
        r = decode_rates(model, tokens, n_ctx, a.decode_tokens, a.reps, a.threads)
        result["decode"].append(r)
        print(f"decode at {n_ctx} tokens of context: f32 {r['decode_tps']['f32']:.0f} tok/s, "
              f"f16 {r['decode_tps']['f16']:.0f} tok/s, f16/f32 {r['f16_over_f32']:.3f}")
    model.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
