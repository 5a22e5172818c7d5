"""Decoding-core benchmark: prefill and decode tokens/s at 1 and 2 threads.

    python bench/core.py [--model PATH] [--reps N] [--decode-tokens N]

Configurations run interleaved (A/B/A/B...) and the medians are reported, so a
noisy neighbour slows every configuration alike. Also reported: the weight
bytes read per decoded token, the machine's memory bandwidth measured with a
numpy copy, and the decode rate that bandwidth would allow. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, CoreError, Model  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "target.gguf"


def memory_bandwidth(n_bytes: int = 1 << 29, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by a numpy copy of a large array."""
    src = np.ones(n_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes / statistics.median(times)


def weight_bytes_per_token(model: Model) -> int:
    """Stored bytes of every tensor a decoded token reads (all but the embedding lookup)."""
    total = 0
    for name, t in model.content.tensors.items():
        if name == "token_embd.weight":
            continue
        total += t.nbytes
    if model.content.tied_output:
        total += model.content.tensors["token_embd.weight"].nbytes
    return total


def prefill_rate(ctx: Context, tokens: list[int]) -> float:
    ctx.clear(0)
    t0 = time.perf_counter()
    ctx.decode(0, tokens)
    return len(tokens) / (time.perf_counter() - t0)


def decode_rate(ctx: Context, prompt: list[int], n: int) -> float:
    ctx.clear(0)
    logits = ctx.decode(0, prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = ctx.decode(0, [int(np.argmax(logits))])
    return n / (time.perf_counter() - t0)


def llama_cpp_rates(path: Path, prompt: list[int], n: int, threads: int) -> dict[str, float]:
    """The same measurement through llama-cpp-python, when it is installed (never in CI)."""
    import llama_cpp  # type: ignore[import-not-found]

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False, logits_all=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:  # the last token's row, straight from llama.cpp
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    pf = len(prompt) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([int(np.argmax(last_logits()))])
    dc = n / (time.perf_counter() - t0)
    return {"prefill_tps": pf, "decode_tps": dc}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Model.load(args.model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_vocab, args.prefill_tokens).tolist()
    short = prompt[:16]
    threads = [1, 2]
    ctxs = {t: Context(model, n_slots=1, n_ctx=args.prefill_tokens + args.decode_tokens + 32,
                       n_threads=t, n_batch=args.prefill_tokens) for t in threads}
    samples: dict[str, list[float]] = {f"{k}_{t}t": [] for k in ("prefill", "decode")
                                       for t in threads}
    for t in threads:  # warm-up
        prefill_rate(ctxs[t], prompt)
        decode_rate(ctxs[t], short, 8)
    for _ in range(args.reps):
        for t in threads:
            samples[f"prefill_{t}t"].append(prefill_rate(ctxs[t], prompt))
            samples[f"decode_{t}t"].append(decode_rate(ctxs[t], short, args.decode_tokens))
    med = {k: statistics.median(v) for k, v in samples.items()}
    wbytes = weight_bytes_per_token(model)
    bw = memory_bandwidth()
    bound = bw / wbytes
    result: dict[str, Any] = {
        "benchmark": "core",
        "model": str(args.model),
        "fingerprint": model.fingerprint[:16],
        "params": model.content.n_params,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads},
        "reps": args.reps,
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "prefill_tps": {f"{t}t": round(med[f"prefill_{t}t"], 1) for t in threads},
        "decode_tps": {f"{t}t": round(med[f"decode_{t}t"], 1) for t in threads},
        "weight_bytes_per_token": wbytes,
        "memory_bandwidth_gbs": round(bw / 1e9, 2),
        "decode_bound_tps": round(bound, 1),
        "decode_2t_vs_bound": round(med["decode_2t"] / bound, 3),
        "prefill_vs_decode_2t": round(med["prefill_2t"] / med["decode_2t"], 1),
        "samples": {k: [round(x, 1) for x in v] for k, v in samples.items()},
    }
    if args.llama_cpp:
        try:
            rates = [llama_cpp_rates(args.model, prompt, args.decode_tokens, 2)
                     for _ in range(args.reps)]
            lc = {k: statistics.median(r[k] for r in rates) for k in rates[0]}
            result["llama_cpp_2t"] = {k: round(v, 1) for k, v in lc.items()}
            result["decode_vs_llama_cpp"] = round(med["decode_2t"] / lc["decode_tps"], 3)
        except ImportError:
            result["llama_cpp_2t"] = "llama-cpp-python is not installed"
    for c in ctxs.values():
        c.close()
    model.close()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--llama-cpp", action="store_true",
                   help="also measure llama-cpp-python on the same GGUF, if installed")
    args = p.parse_args()
    try:
        result = run(args)
    except CoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k in ("prefill_tps", "decode_tps"):
        print(f"{k}: {result[k]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
