"""KV cache type: slot state size and decode speed, f16 against f32 and q8_0.

    .venv/bin/python bench/kv_cache.py [--model PATH] [--state-tokens 2000]
        [--contexts 128,4000] [--decode-tokens 64] [--reps 7] [--threads 2]
        [--types f32,f16,q8_0] [--no-decode] [--llama-cpp SITE_PACKAGES]
    .venv/bin/python bench/kv_cache.py --before REV [--model models/X.gguf] [--reps 7]

State: a slot holding --state-tokens tokens (random ids, one prefill) in a context of
each of --types: the core's state size and the size of the slot file the service
writes for it (encode_slot, the path SaveSlot takes). With --llama-cpp (a
site-packages directory holding llama-cpp-python, appended to sys.path so this
venv's packages win), llama.cpp's per-sequence state size
(llama_state_seq_get_size) for the same token ids in a context with its default
KV type (F16), and our f16 file size against it.

Decode: for each context length, the contexts are prefilled once to that length,
then the repetitions alternate (f32, f16, q8_0, q8_0, f16, f32, ...): truncate back to
the length and decode --decode-tokens tokens one at a time. Medians per type and the
ratios to f16 of the medians (`f16_over_f32`, `q8_0_over_f16`), of wall-clock rates
and of rates per CPU second of the
process (with --threads 1 the CPU time is the decoding thread's alone, which a
loaded machine disturbs far less than the wall clock: time spent waiting for a core
does not count). The last line printed is one JSON object.

--before REV: the product path against an older commit instead. REV's tree is
exported (git archive) to a temporary directory and its native core built there;
then fresh processes in rotating order (REV with its default KV, this tree with f32,
this tree with f16), 1 thread, each decoding 128 tokens after a 128-token prompt and
64 tokens at 4000 tokens of context (after a warm-up pass of each), rates per CPU
second; medians and the ratios to REV.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.core import Context, Model  # noqa: E402
from inference_svc.storage.snapshots import context_spec, encode_slot  # noqa: E402

KV_TYPES = ("f32", "f16", "q8_0")


def ratios(med: dict[str, float], suffix: str = "") -> dict[str, float]:
    """f16/f32 and every other type / f16, of the types measured."""
    out = {}
    if "f16" in med and "f32" in med:
        out[f"f16_over_f32{suffix}"] = med["f16"] / med["f32"]
    for kv in med:
        if kv not in ("f16", "f32") and "f16" in med:
            out[f"{kv}_over_f16{suffix}"] = med[kv] / med["f16"]
    return out


def prefill(ctx: Context, tokens: list[int], chunk: int = 512) -> None:
    ctx.clear(0)
    for i in range(0, len(tokens), chunk):
        ctx.decode(0, tokens[i:i + chunk])


def state_sizes(model: Model, tokens: list[int], threads: int,
                types: tuple[str, ...]) -> dict[str, dict[str, int]]:
    out = {}
    for kv in types:
        with Context(model, n_ctx=len(tokens), n_threads=threads, kv_type=kv) as ctx:
            prefill(ctx, tokens)
            state = ctx.get_state(0)
            slot = encode_slot(state, None, context_spec(ctx), None)
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
                 threads: int, types: tuple[str, ...]) -> dict[str, Any]:
    ctxs = {kv: Context(model, n_ctx=n_ctx + n_decode, n_threads=threads, kv_type=kv)
            for kv in types}
    try:
        for ctx in ctxs.values():
            prefill(ctx, tokens[:n_ctx])
        follow = tokens[n_ctx:n_ctx + n_decode]
        rates: dict[str, list[float]] = {kv: [] for kv in types}
        cpu: dict[str, list[float]] = {kv: [] for kv in types}
        order = list(types)
        for _ in range(reps + 1):  # the first round warms up and is dropped
            for kv in order:
                ctx = ctxs[kv]
                ctx.truncate(0, n_ctx)
                t0, c0 = time.perf_counter(), time.process_time()
                for t in follow:
                    ctx.decode(0, [t])
                rates[kv].append(n_decode / (time.perf_counter() - t0))
                cpu[kv].append(n_decode / (time.process_time() - c0))
            order.reverse()
        med = {kv: statistics.median(r[1:]) for kv, r in rates.items()}
        med_cpu = {kv: statistics.median(r[1:]) for kv, r in cpu.items()}
        return {"context": n_ctx, "decode_tps": med, **ratios(med),
                "decode_per_cpu_s": med_cpu, **ratios(med_cpu, "_cpu"),
                "runs": {kv: [round(x, 1) for x in r[1:]] for kv, r in rates.items()}}
    finally:
        for ctx in ctxs.values():
            ctx.close()


BEFORE_PROBE = r'''
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from inference_svc.core.model import Context, Model
m = Model.load(sys.argv[3])
rnd = random.Random(1)
toks = [rnd.randrange(m.n_vocab) for _ in range(4100)]
kw = {} if sys.argv[2] == "default" else {"kv_type": sys.argv[2]}
out = {}
with Context(m, n_slots=1, n_ctx=4096 + 64, n_threads=1, **kw) as c:
    c.decode(0, toks[:128])
    for rep in range(2):  # the first pass warms up
        c.truncate(0, 128)
        t = time.process_time()
        for i in range(128):
            c.decode(0, [toks[600 + i]])
        out["decode_short_cpu_tps"] = 128 / (time.process_time() - t)
    c.clear(0)
    for i in range(0, 4000, 512):
        c.decode(0, toks[i:min(i + 512, 4000)])
    for rep in range(2):
        c.truncate(0, 4000)
        t = time.process_time()
        for i in range(64):
            c.decode(0, [toks[i]])
        out["decode_at_4k_cpu_tps"] = 64 / (time.process_time() - t)
print(json.dumps(out))
'''


def against_before(rev: str, model: Path, reps: int) -> dict[str, Any]:
    """REV (its default KV type) against this tree's f32 and f16, fresh processes."""
    tmp = Path(tempfile.mkdtemp(prefix="warmslot-kv-before-"))
    try:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        subprocess.run([sys.executable, "native/build_ffi.py", "--variant", "release"],
                       cwd=tmp, check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(tmp)})
        confs = {"before": (tmp, "default"), "f32": (ROOT, "f32"), "f16": (ROOT, "f16")}
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in confs}
        order = list(confs)
        for _ in range(reps):
            for k in order:
                tree, kv = confs[k]
                out = subprocess.run([sys.executable, "-c", BEFORE_PROBE, str(tree), kv,
                                      str(model.resolve())], cwd=tree, check=True,
                                     capture_output=True, text=True).stdout
                runs[k].append(json.loads(out.strip().splitlines()[-1]))
            order = order[1:] + order[:1]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    ratio = {k: {m: med[k][m] / med["before"][m] for m in med[k]} for k in ("f32", "f16")}
    return {"before": rev, "model": model.name, "reps": reps, "median_cpu_tps": med,
            "over_before": ratio, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "target.gguf")
    ap.add_argument("--state-tokens", type=int, default=2000)
    ap.add_argument("--contexts", default="128,4000", help="context lengths for decode")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(KV_TYPES),
                    help="KV types to measure (f16 among them: the ratios are to it)")
    ap.add_argument("--no-decode", action="store_true", help="state sizes only")
    ap.add_argument("--llama-cpp", metavar="SITE_PACKAGES",
                    help="also measure llama.cpp's per-sequence state size")
    ap.add_argument("--before", metavar="REV",
                    help="compare decode per CPU second with git revision REV instead")
    a = ap.parse_args()
    if a.before:
        r = against_before(a.before, a.model, a.reps)
        for k, v in r["over_before"].items():
            print(f"{k} / {a.before}: decode short {v['decode_short_cpu_tps']:.3f}, "
                  f"at 4k {v['decode_at_4k_cpu_tps']:.3f}")
        print(json.dumps(r))
        return 0
    model = Model.load(a.model)
    contexts = [int(x) for x in a.contexts.split(",") if x] if not a.no_decode else []
    n_tok = max([a.state_tokens, *(c + a.decode_tokens for c in contexts)])
    tokens = np.random.default_rng(0).integers(0, model.n_vocab, n_tok).tolist()
    types = tuple(t for t in a.types.split(",") if t)
    if "f16" not in types or any(t not in KV_TYPES for t in types):
        ap.error(f"--types: some of {', '.join(KV_TYPES)}, f16 among them")
    result: dict[str, Any] = {"model": a.model.name, "threads": a.threads,
                              "state_tokens": a.state_tokens,
                              "native": os.environ.get("WARMSLOT_NATIVE", "release")}
    st = state_sizes(model, tokens[:a.state_tokens], a.threads, types)
    result["state"] = st
    result.update(ratios({kv: float(v["state_bytes"]) for kv, v in st.items()}, "_state"))
    print(f"state of {a.state_tokens} tokens: " + ", ".join(
        f"{kv} {v['state_bytes'] / 1e6:.2f} MB (slot file {v['slot_file_bytes'] / 1e6:.2f} MB)"
        for kv, v in st.items()))
    if a.llama_cpp:
        ll = llama_cpp_state_size(a.llama_cpp, a.model, tokens[:a.state_tokens], a.threads)
        result["llama_cpp_state_bytes"] = ll
        result["f16_slot_file_over_llama_cpp"] = st["f16"]["slot_file_bytes"] / ll
        print(f"llama.cpp per-sequence state: {ll / 1e6:.2f} MB; our f16 slot file / "
              f"llama.cpp: {result['f16_slot_file_over_llama_cpp']:.3f}")
    result["decode"] = []
    for n_ctx in contexts:
        r = decode_rates(model, tokens, n_ctx, a.decode_tokens, a.reps, a.threads, types)
        result["decode"].append(r)
        print(f"decode at {n_ctx} tokens of context: " + ", ".join(
            f"{kv} {v:.0f} tok/s" for kv, v in r["decode_tps"].items()) + "; " + ", ".join(
            f"{k} {v:.3f}" for k, v in r.items() if "_over_" in k))
    model.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
