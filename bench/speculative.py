"""Speculative decoding benchmark on held-out prompts from the validation files.

    python bench/speculative.py [--target PATH] [--draft PATH] [--n-max 2 4 8]

For temperature 0 and 0.8, decodes the same prompts target-only and with the
draft proposing n_max tokens, interleaved prompt by prompt so that every
configuration sees the same machine load; reports decode tokens/s (medians),
the speed-up against target-only from the same run, the acceptance rate and
the tokens produced per target pass. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from corpus import load_corpus  # noqa: E402

from inference_svc.core import Context, CoreError, Model  # noqa: E402
from inference_svc.core.speculative import (  # noqa: E402
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)

CORPUS_SEED = 1234  # the split tools/train_models.py trains with


def held_out_prompts(tok: Any, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of n validation files (long enough ones, fixed order)."""
    valid = sorted(load_corpus(CORPUS_SEED).valid, key=lambda f: f.rel)
    prompts = []
    for f in valid:
        ids = tok.encode(f.text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def decode_run(dec: SpecDecoder, prompt: list[int], n_new: int, sp: SamplingParams,
               spec: SpecParams, seed: int) -> dict[str, float]:
    dec.clear(0)
    dec.seed(0, seed)
    before = dec.counters(0)
    out = [dec.prefill(0, prompt, sp, with_draft=spec.n_max > 0)]
    t0 = time.perf_counter()
    while len(out) < n_new:
        out += dec.step(0, sp, spec, n_new - len(out))
    dt = time.perf_counter() - t0
    c = dec.counters(0) - before
    return {"tps": (len(out) - 1) / dt, "drafted": c.n_drafted, "accepted": c.n_accepted,
            "passes": c.n_steps, "tokens": len(out) - 1}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tm, dm = Model.load(args.target), Model.load(args.draft)
    n_ctx = args.prompt_tokens + args.new_tokens + 32
    tc = Context(tm, n_slots=1, n_ctx=n_ctx, n_threads=args.threads)
    dc = Context(dm, n_slots=1, n_ctx=n_ctx, n_threads=args.draft_threads)
    dec = SpecDecoder(tc, dc)
    prompts = held_out_prompts(tm.tokenizer, args.prompts, args.prompt_tokens)
    configs = [("target_only", NO_SPEC)] + [
        (f"n_max_{n}" + (f"_p_min_{p}" if p else ""), SpecParams(n_max=n, p_min=p))
        for p in args.p_min for n in args.n_max]
    results: dict[str, Any] = {}
    for temp in args.temperatures:
        sp = SamplingParams(temperature=temp, top_k=40, top_p=0.95, min_p=0.05) if temp else \
            SamplingParams()
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
        decode_run(dec, prompts[0], 16, sp, configs[-1][1], 0)  # warm-up
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts):
                for name, spec in configs:
                    runs[name].append(decode_run(dec, prompt, args.new_tokens, sp, spec,
                                                 seed=1000 * rep + i))
        base = statistics.median(r["tps"] for r in runs["target_only"])
        per: dict[str, Any] = {}
        for name, _ in configs:
            rs = runs[name]
            tps = statistics.median(r["tps"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            accepted = sum(r["accepted"] for r in rs)
            per[name] = {
                "decode_tps": round(tps, 1),
                "speedup": round(tps / base, 3),
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_pass": round(sum(r["tokens"] for r in rs)
                                         / sum(r["passes"] for r in rs), 3),
            }
        results[f"t{temp}"] = per
    dec.close()
    for obj in (tc, dc, tm, dm):
        obj.close()
    return {
        "benchmark": "speculative",
        "target": str(args.target),
        "draft": str(args.draft),
        "threads": args.threads,
        "draft_threads": args.draft_threads,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "results": results,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=ROOT / "models" / "target.gguf")
    p.add_argument("--draft", type=Path, default=ROOT / "models" / "draft.gguf")
    p.add_argument("--n-max", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--p-min", type=float, nargs="+", default=[0.0, 0.75],
                   help="draft confidence thresholds (each with every n_max)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--threads", type=int, default=2, help="target threads")
    p.add_argument("--draft-threads", type=int, default=1, help="draft threads")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    try:
        result = run(args)
    except CoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for t, per in result["results"].items():
        for name, r in per.items():
            print(f"{t} {name}: {r}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
