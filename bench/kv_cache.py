"""KV cache type: slot state size and decode speed, f16 against f32.

    .venv/bin/python bench/kv_cache.py [--model PATH] [--state-tokens 2000]
        [--contexts 128,4000] [--decode-tokens 64] [--reps 7] [--threads 2]
        [--no-decode] [--llama-cpp SITE_PACKAGES]
    .venv/bin/python bench/kv_cache.py --before REV [--model models/X.gguf] [--reps 7]

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
f16/f32 ratio of the medians, of wall-clock rates and of rates per CPU second of the
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
from inference_svc.snapshots import context_spec, encode_slot  # noqa: E402

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
                 threads: int) -> dict[str, Any]:
    ctxs = {kv: Context(model, n_ctx=n_ctx + n_decode, n_threads=threads, kv_type=kv)
            for kv in KV_TYPES}
    try:
        for ctx in ctxs.values():
            prefill(ctx, tokens[:n_ctx])
        follow = tokens[n_ctx:n_ctx + n_decode]
        rates: dict[str, list[float]] = {kv: [] for kv in KV_TYPES}
        cpu: dict[str, list[float]] = {kv: [] for kv in KV_TYPES}
        order = list(KV_TYPES)
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
        return {"context": n_ctx, "decode_tps": med, "f16_over_f32": med["f16"] / med["f32"],
                "decode_per_cpu_s": med_cpu,
                "f16_over_f32_cpu": med_cpu["f16"] / med_cpu["f32"],
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
              f"f16 {r['decode_tps']['f16']:.0f} tok/s, f16/f32 {r['f16_over_f32']:.3f}; per "
              f"CPU second f16/f32 {r['f16_over_f32_cpu']:.3f}")
    model.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
