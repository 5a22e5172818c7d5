"""Decoding-core benchmark: prefill, decode and verification-batch rates at 1 and 2
threads, load time and resident memory, optionally side by side with llama.cpp.

    python bench/core.py [--model PATH] [--reps N] [--prefill-tokens N]
                         [--decode-tokens N] [--llama-cpp [--llama-cpp-path DIR]]

Every repetition runs every configuration once, interleaved (ours 1t, llama.cpp 1t,
ours 2t, llama.cpp 2t, ...), and the medians are reported, so a noisy neighbour slows
every configuration alike. Each engine is loaded once and warmed up. Both engines get
the same work: the same prompt token ids (prefill), then the same fixed decode token
ids fed one at a time right after that prompt (so decode runs at the same context
length), logits of the last token each step.

Also reported: the weight bytes read per decoded token, the machine's memory bandwidth
(a numpy copy) and the fraction of the decode rate that bandwidth allows; a 5-token
verification batch (every token's logits) against a single-token decode (1 thread, after
the prompt; llama.cpp's too, in a context of its own that keeps every token's logits);
the time of a second load of the model (the first one warmed the page cache and the
fingerprint cache); the resident memory after load and one decode, each engine alone
in a fresh process. The CPU's model and vector class, the kernels our build compiled
(ws_kernel_path; WARMSLOT_NATIVE picks the build) and llama.cpp's version and system info
(its instruction sets) are recorded beside the figures. The last line printed is one JSON
object.

llama-cpp-python is never a dependency: --llama-cpp-path names the site-packages of a
venv where it is installed (appended to sys.path, so this venv's packages come first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_class, cpu_model  # noqa: E402

from inference_svc.core import Context, CoreError, Model  # noqa: E402
from inference_svc.core.binding import NATIVE_VARIANT, kernel_path  # noqa: E402

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


VERIFY_TOKENS = 5

# one engine alone in a fresh process: VmRSS after load and one 16-token decode
RSS_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
engine, model = sys.argv[2], sys.argv[3]
if engine == "ours":
    from inference_svc.core import Context, Model
    m = Model.load(model)
    ctx = Context(m, n_ctx=int(sys.argv[4]), n_threads=1)
    ctx.decode(0, list(range(16)))
else:
    sys.path.append(sys.argv[5])
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=int(sys.argv[4]), n_threads=1,
                          n_threads_batch=1, verbose=False)
    llm.eval(list(range(16)))
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]) * 1024)
"""


def rss_after_load(engine: str, model: Path, n_ctx: int, llama_path: str) -> int | None:
    try:
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(ROOT), engine, str(model),
                              str(n_ctx), llama_path], capture_output=True, text=True,
                             timeout=300, check=True).stdout.split()
        return int(out[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


class Ours:
    """Our core: one model, one context per thread count."""

    name = "ours"

    def __init__(self, path: Path, n_ctx: int, n_batch: int, threads: list[int]) -> None:
        self.model = Model.load(path)
        self.ctxs = {t: Context(self.model, n_slots=1, n_ctx=n_ctx, n_threads=t,
                                n_batch=n_batch) for t in threads}
        self.ctx = self.ctxs[threads[0]]

    def use_threads(self, t: int) -> None:
        self.ctx = self.ctxs[t]

    def reset(self) -> None:
        self.ctx.clear(0)

    def eval(self, tokens: list[int]) -> None:
        self.ctx.decode(0, tokens)

    def verify(self, tokens: list[int]) -> None:
        """A verification batch: every token's logits, then rolled back."""
        n = self.ctx.n_tokens(0)
        self.ctx.decode(0, tokens, logits_all=True)
        self.ctx.truncate(0, n)

    def close(self) -> None:
        for c in self.ctxs.values():
            c.close()
        self.model.close()


class LlamaCpp:
    """llama.cpp through llama-cpp-python: one model and context, threads set per run."""

    name = "llama_cpp"

    def __init__(self, path: Path, n_ctx: int, n_batch: int, threads: list[int]) -> None:
        import llama_cpp  # type: ignore[import-not-found]

        self.lib = llama_cpp
        self.version = str(getattr(llama_cpp, "__version__", "?"))
        self.system_info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads[0],
                                   n_threads_batch=threads[0], n_batch=n_batch, verbose=False)
        # verification needs every token's logits, which this context computes for every
        # eval (prefill too): a context of its own, so the prefill figures stay last-token
        self.vllm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads[0],
                                    n_threads_batch=threads[0], n_batch=n_batch,
                                    logits_all=True, verbose=False)

    def use_threads(self, t: int) -> None:
        for llm in (self.llm, self.vllm):
            self.lib.llama_set_n_threads(llm._ctx.ctx, t, t)

    def verify(self, tokens: list[int]) -> None:
        """A verification batch: every token's logits (copied out by llama-cpp-python, 4
        bytes x vocabulary per token), then rolled back (the next eval drops the KV past
        n_tokens)."""
        n = self.vllm.n_tokens
        self.vllm.eval(tokens)
        self.vllm.n_tokens = n

    def prompt(self, tokens: list[int]) -> None:
        """The prompt into the verification context (after a reset)."""
        self.vllm.reset()
        self.vllm.eval(tokens)

    def reset(self) -> None:
        self.llm.reset()

    def eval(self, tokens: list[int]) -> None:
        self.llm.eval(tokens)  # computes the last token's logits

    def close(self) -> None:
        self.llm.close()
        self.vllm.close()


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(engine: Any, prompt: list[int], decode_ids: list[int]) -> dict[str, float]:
    """Prefill of the prompt, then the decode ids one by one after it."""
    engine.reset()
    pf = timed(lambda: engine.eval(prompt))
    dc = timed(lambda: [engine.eval([t]) for t in decode_ids])
    return {"prefill": len(prompt) / pf, "decode": len(decode_ids) / dc}


def verify_ratio(engine: Any, prompt: list[int], ids: list[int], reps: int = 8) -> float:
    """Time of a VERIFY_TOKENS-token batch over the time of a one-token decode, both
    at the prompt's length, with every token's logits, rolled back; medians over reps
    interleaved."""
    if isinstance(engine, LlamaCpp):
        engine.prompt(prompt)
    else:
        engine.reset()
        engine.eval(prompt)
    one, batch = [], []
    for _ in range(reps):
        one.append(timed(lambda: engine.verify(ids[:1])))
        batch.append(timed(lambda: engine.verify(ids[:VERIFY_TOKENS])))
    return statistics.median(batch) / statistics.median(one)


def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = [1, 2]
    n_ctx = args.prefill_tokens + args.decode_tokens + 32
    t0 = time.perf_counter()
    ours = Ours(args.model, n_ctx, args.prefill_tokens, threads)
    first_load = time.perf_counter() - t0
    engines: list[Any] = [ours]
    llama_note = None
    llama_build: dict[str, str] = {}
    if args.llama_cpp:
        if args.llama_cpp_path:
            sys.path.append(args.llama_cpp_path)
        try:
            llama = LlamaCpp(args.model, n_ctx, args.prefill_tokens, threads)
            engines.append(llama)
            llama_build = {"version": llama.version, "system_info": llama.system_info,
                           "path": args.llama_cpp_path}
        except ImportError:
            llama_note = "llama-cpp-python is not importable (see --llama-cpp-path)"
    rng = np.random.default_rng(0)
    n_vocab = ours.model.n_vocab
    prompt = rng.integers(0, n_vocab, args.prefill_tokens).tolist()
    decode_ids = rng.integers(0, n_vocab, args.decode_tokens).tolist()
    for e in engines:  # warm-up
        for t in threads:
            e.use_threads(t)
            measure(e, prompt[:64], decode_ids[:8])
    samples: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for t in threads:
            for e in engines:
                e.use_threads(t)
                for k, v in measure(e, prompt, decode_ids).items():
                    samples.setdefault(f"{e.name}_{k}_{t}t", []).append(v)
    med = {k: statistics.median(v) for k, v in samples.items()}
    verify = {}
    for e in engines:
        e.use_threads(1)
        verify[e.name] = verify_ratio(e, prompt, decode_ids)
    wbytes = weight_bytes_per_token(ours.model)
    params = ours.model.content.n_params
    fingerprint = ours.model.fingerprint
    for e in engines:
        e.close()
    t0 = time.perf_counter()
    second = Model.load(args.model)
    second_load = time.perf_counter() - t0
    second.close()
    bw = memory_bandwidth()
    bound = bw / wbytes

    def rates(engine: str, kind: str) -> dict[str, float]:
        return {f"{t}t": round(med[f"{engine}_{kind}_{t}t"], 1) for t in threads}

    result: dict[str, Any] = {
        "benchmark": "core",
        "model": str(args.model),
        "fingerprint": fingerprint[:16],
        "params": params,
        "machine": {"cpu": cpu_model(), "cpu_class": cpu_class(), "threads": threads,
                    "loadavg_1m": round(os.getloadavg()[0], 2)},
        "ours_kernels": {"build": NATIVE_VARIANT, "path": kernel_path()},
        "reps": args.reps,
        "prefill_tokens": args.prefill_tokens,
        "decode_tokens": args.decode_tokens,
        "decode_context": f"{args.prefill_tokens}..{args.prefill_tokens + args.decode_tokens}",
        "prefill_tps": rates("ours", "prefill"),
        "decode_tps": rates("ours", "decode"),
        "verify_batch": VERIFY_TOKENS,
        "verify_vs_decode_1t": round(verify["ours"], 3),
        "first_load_s": round(first_load, 3),
        "second_load_s": round(second_load, 3),
        "weight_bytes_per_token": wbytes,
        "memory_bandwidth_gbs": round(bw / 1e9, 2),
        "decode_bound_tps": round(bound, 1),
        "decode_vs_bound": {f"{t}t": round(med[f"ours_decode_{t}t"] / bound, 3)
                            for t in threads},
        "samples": {k: [round(x, 1) for x in v] for k, v in samples.items()},
    }
    llama_path = args.llama_cpp_path or ""
    rss_ours = rss_after_load("ours", args.model, n_ctx, llama_path)
    result["rss_after_load_mib"] = {
        "ours": None if rss_ours is None else round(rss_ours / 2**20, 1)}
    if llama_note:
        result["llama_cpp"] = llama_note
    elif args.llama_cpp:
        result["llama_cpp"] = {"prefill_tps": rates("llama_cpp", "prefill"),
                               "decode_tps": rates("llama_cpp", "decode"), "build": llama_build,
                               "verify_vs_decode_1t": round(verify["llama_cpp"], 3)}
        result["vs_llama_cpp"] = {
            f"{kind}_{t}t": round(med[f"ours_{kind}_{t}t"] / med[f"llama_cpp_{kind}_{t}t"], 3)
            for kind in ("prefill", "decode") for t in threads}
        rss_llama = rss_after_load("llama", args.model, n_ctx, llama_path)
        if rss_llama is not None:
            result["rss_after_load_mib"]["llama_cpp"] = round(rss_llama / 2**20, 1)
            if rss_ours is not None:
                result["rss_vs_llama_cpp"] = round(rss_ours / rss_llama, 3)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--llama-cpp", action="store_true",
                   help="also measure llama-cpp-python on the same GGUF, interleaved")
    p.add_argument("--llama-cpp-path", default=os.environ.get("WARMSLOT_LLAMA_CPP_PATH", ""),
                   help="site-packages of a venv holding llama-cpp-python "
                        "(default: $WARMSLOT_LLAMA_CPP_PATH)")
    args = p.parse_args()
    try:
        result = run(args)
    except CoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k in ("machine", "ours_kernels", "prefill_tps", "decode_tps", "verify_vs_decode_1t",
              "llama_cpp", "vs_llama_cpp"):
        if k in result:
            print(f"{k}: {result[k]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
