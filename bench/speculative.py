"""Speculative decoding benchmark on held-out prompts, by domain.

    python bench/speculative.py [--model PATH] [--draft PATH] [--n-max 2 4 8]
                                [--domains code prose chat]

Prompts (bench/prompts.py): code = stdlib validation files, prose = the
language reference topics of pydoc_data, chat = hand-written questions in the
ChatML template (models with <|im_start|> only). For each domain and
temperature 0 and 0.8, decodes the same prompts target-only and with the
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
sys.path.insert(0, str(ROOT / "bench"))

from prompts import DOMAINS, domain_prompts  # noqa: E402

from inference_svc.core import Context, CoreError, Model  # noqa: E402
from inference_svc.core.speculative import (  # noqa: E402
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)


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


def draft_cost(tm: Model, dm: Model, args: argparse.Namespace,
               n_tokens: int = 64) -> dict[str, float]:
    """Median time of one single-token decode of the draft over the target's (each at the
    thread count speculation gives it), interleaved token by token after a 32-token
    prefill of the same ids."""
    ids = list(range(100, 132))
    times: dict[str, list[float]] = {"target": [], "draft": []}
    with Context(tm, n_slots=1, n_ctx=128, n_threads=args.threads) as tc, \
            Context(dm, n_slots=1, n_ctx=128, n_threads=args.draft_threads) as dc:
        ctxs = {"target": tc, "draft": dc}
        for ctx in ctxs.values():
            ctx.decode(0, ids)
        for i in range(n_tokens):
            for name, ctx in ctxs.items():
                t0 = time.perf_counter()
                ctx.decode(0, [200 + i])
                times[name].append(time.perf_counter() - t0)
    target, draft = (statistics.median(times[k]) for k in ("target", "draft"))
    return {"target_ms": round(target * 1e3, 3), "draft_ms": round(draft * 1e3, 3),
            "draft_over_target": round(draft / target, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    tm, dm = Model.load(args.target), Model.load(args.draft)
    cost = draft_cost(tm, dm, args)
    n_ctx = args.prompt_tokens + args.new_tokens + 32
    tc = Context(tm, n_slots=1, n_ctx=n_ctx, n_threads=args.threads)
    dc = Context(dm, n_slots=1, n_ctx=n_ctx, n_threads=args.draft_threads)
    dec = SpecDecoder(tc, dc)
    configs = [("target_only", NO_SPEC)] + [
        (f"n_max_{n}" + (f"_p_min_{p}" if p else ""), SpecParams(n_max=n, p_min=p))
        for p in args.p_min for n in args.n_max]
    results: dict[str, Any] = {}
    n_prompts: dict[str, int] = {}
    for domain in args.domains:
        prompts = domain_prompts(tm.tokenizer, domain, args.prompts, args.prompt_tokens)
        n_prompts[domain] = len(prompts)
        results[domain] = run_domain(dec, prompts, configs, args)
    dec.close()
    for obj in (tc, dc, tm, dm):
        obj.close()
    return {
        "benchmark": "speculative",
        "target": str(args.target),
        "draft": str(args.draft),
        "threads": args.threads,
        "draft_threads": args.draft_threads,
        "prompts": n_prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "draft_cost": cost,
        "results": results,
    }


def run_domain(dec: SpecDecoder, prompts: list[list[int]],
               configs: list[tuple[str, SpecParams]], args: argparse.Namespace) -> dict[str, Any]:
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
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--target", dest="target", type=Path,
                   default=ROOT / "models" / "target.gguf")
    p.add_argument("--draft", type=Path, default=ROOT / "models" / "draft.gguf")
    p.add_argument("--domains", nargs="+", choices=DOMAINS, default=["code"])
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
    except (CoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"draft cost: {result['draft_cost']}", file=sys.stderr)
    for domain, temps in result["results"].items():
        for t, per in temps.items():
            for name, r in per.items():
                print(f"{domain} {t} {name}: {r}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
