"""Speculative decoding benchmark on held-out prompts, by domain.

    python bench/speculative.py [--path engine|service|core] [--model PATH]
                                [--draft PATH|none] [--head PATH|none] [--no-lookup]
                                [--domains code prose chat grounded random] [--threads 2]

Prompts (bench/prompts.py): code = stdlib validation files, prose = the
language reference topics of pydoc_data, chat = hand-written questions in the
model's chat template, grounded = requests whose answer copies from code, text or
a record given in the prompt, random = random token ids (bench/prompts.py).

--path engine (default) and --path service measure the product's path: requests
to the engine in this process, or through the gRPC service (`python -m
inference_svc` on 127.0.0.1), with the server's speculative defaults (both
drafters, adaptive draft lengths, n_max 8, p_min 0.75; --no-lookup: the draft
model alone; --draft none: the lookup drafter alone; --head PATH: the feature head
drafts where lookup does not, before the draft model). Per drafter it reports the
proposals, their acceptance and the tokens per target pass. For each domain and
temperature 0 and 0.8 the same prompts run target-only (speculative off) and
speculative, interleaved prompt by prompt in a rotating order so both see the
same machine load: decode tokens/s (the server's own predicted_per_second,
medians), the speed-up from the same run, the acceptance and the tokens per
target pass. Greedy runs must give the same tokens both ways. Then concurrency:
four requests one after the other against the same four at once on four slots
(speculative, then target-only), interleaved, both warmed up, the same tokens
each way (checked): aggregate tokens/s over the wall time and the ratio
(--concurrency-only: this part alone).

--path core drives the speculative decoder directly with fixed draft lengths
(--n-max, --p-min): acceptance and tokens per target pass by draft length.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
from prompts import DOMAINS, domain_prompts  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.config import Config  # noqa: E402
from inference_svc.core import Context, CoreError, Model  # noqa: E402
from inference_svc.core.head import Head  # noqa: E402
from inference_svc.core.speculative import (  # noqa: E402
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)
from inference_svc.engine.executor import Engine  # noqa: E402
from inference_svc.engine.slot_owner import SlotOwner  # noqa: E402
from inference_svc.metrics import Metrics  # noqa: E402
from inference_svc.pb import inference_pb2 as pb  # noqa: E402
from inference_svc.types import GenerateParams, speculative_from_pb  # noqa: E402

SLOTS = 4
HOT = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    slot: int
    n: int
    temperature: float
    seed: int
    speculative: bool


@dataclass
class Out:
    tokens: list[int]
    tps: float  # the server's decode rate
    drafted: int
    accepted: int
    steps: int
    looked_up: int = 0  # of drafted / accepted: the lookup drafter's
    lookup_accepted: int = 0
    head_drafted: int = 0  # of drafted / accepted: the feature head's
    head_accepted: int = 0


def out_of(toks: list[int], t: Any) -> Out:
    """An Out from a request's tokens and its Timings (engine or protobuf)."""
    return Out(toks, t.predicted_per_second, t.draft_n, t.draft_n_accepted, t.n_steps,
               t.lookup_n, t.lookup_n_accepted, t.head_n, t.head_n_accepted)


class EngineRunner:
    """Requests to an in-process engine: the path the gRPC handlers take, minus gRPC."""

    def __init__(self, args: argparse.Namespace, n_ctx: int) -> None:
        cfg = Config(model=args.target, draft=args.draft, head=args.head, slots=SLOTS,
                     ctx=n_ctx, threads=args.threads, draft_threads=args.draft_threads, seed=1,
                     log_level="warning", log_format="text")
        self.tm = Model.load(args.target)
        self.dm = Model.load(args.draft) if args.draft else None
        self.hm = Head(args.head, self.tm) if args.head else None
        self.engine = Engine(cfg, SlotOwner(cfg, self.tm, self.dm, self.hm), Metrics())
        # the defaults of a request that sets no speculative field but, with
        # --no-lookup, lookup off
        self.spec = speculative_from_pb(
            pb.SpeculativeParams(lookup=False) if args.no_lookup else pb.SpeculativeParams(),
            cfg, has_draft=self.dm is not None, has_head=self.hm is not None)

    def run(self, reqs: list[Req]) -> list[Out]:
        jobs = []
        for r in reqs:
            sp = HOT if r.temperature else SamplingParams()
            jobs.append(self.engine.generate(GenerateParams(
                tuple(r.prompt), r.n, r.slot, False, sp, r.seed,
                self.spec if r.speculative else None)))
        outs = []
        for job in jobs:
            toks, t = job.collect(timeout=900)
            outs.append(out_of(toks, t))
        return outs

    def close(self) -> None:
        self.engine.close()
        if self.hm is not None:
            self.hm.close()
        self.tm.close()
        if self.dm is not None:
            self.dm.close()


class ServiceRunner:
    """Requests through the gRPC service, one client thread per request."""

    def __init__(self, args: argparse.Namespace, n_ctx: int) -> None:
        from service import Service

        self.svc = Service(argparse.Namespace(ctx=n_ctx, threads=args.threads, n_max=8),
                           args.target, args.draft,
                           ("--head", str(args.head) if args.head else "none",
                            *args.service_flag))
        self.lookup = False if args.no_lookup else None
        self.tm = Model.load(args.target)

    def run(self, reqs: list[Req]) -> list[Out]:
        outs: list[Out | None] = [None] * len(reqs)
        errors: list[BaseException] = []

        def one(i: int, r: Req) -> None:
            try:
                with InferenceClient(f"127.0.0.1:{self.svc.port}", timeout=900) as c:
                    kw: dict[str, Any] = dict(temperature=r.temperature, seed=r.seed)
                    if r.temperature:
                        kw.update(top_k=HOT.top_k, top_p=HOT.top_p, min_p=HOT.min_p)
                    req = make_request(r.prompt, max_tokens=r.n, id_slot=r.slot,
                                       cache_prompt=False, speculative=r.speculative,
                                       lookup=self.lookup, **kw)
                    toks: list[int] = []
                    last = None
                    for resp in c.generate_stream(req):
                        toks += resp.tokens
                        last = resp
                    assert last is not None and last.done
                    outs[i] = out_of(toks, last.timings)
            except BaseException as exc:  # noqa: BLE001 - raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [o for o in outs if o is not None]

    def close(self) -> None:
        self.svc.stop()
        self.tm.close()


def product_path(args: argparse.Namespace) -> dict[str, Any]:
    n_ctx = args.prompt_tokens + args.new_tokens + 64
    runner: EngineRunner | ServiceRunner = (EngineRunner(args, n_ctx) if args.path == "engine"
                                            else ServiceRunner(args, n_ctx))
    try:
        tok = runner.tm.tokenizer
        single: dict[str, Any] = {}
        for domain in [] if args.concurrency_only else args.domains:
            ps = domain_prompts(tok, domain, args.prompts, args.prompt_tokens)
            single[domain] = {f"t{t}": single_streams(runner, ps, t, args)
                              for t in args.temperatures}
        ps = domain_prompts(tok, args.domains[0], SLOTS, args.prompt_tokens)
        concurrent = {mode: concurrency(runner, ps, mode == "speculative", args)
                      for mode in ("speculative", "target_only")}
    finally:
        runner.close()
    return {"benchmark": "speculative", "path": args.path, "target": str(args.target),
            "draft": str(args.draft), "head": str(args.head), "lookup": not args.no_lookup,
            "service_flags": args.service_flag if args.path == "service" else [],
            "threads": args.threads, "cpu": machine.cpu_model(), "cpu_class": machine.cpu_class(),
            "native": os.environ.get("WARMSLOT_NATIVE", "release"),
            "draft_threads": args.draft_threads, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "reps": args.reps, "prompts": args.prompts,
            "single": single, "concurrent": concurrent,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def single_streams(runner: EngineRunner | ServiceRunner, ps: list[list[int]], temp: float,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One stream at a time: target-only against speculative, interleaved."""
    runs: dict[str, list[Out]] = {"target_only": [], "speculative": []}
    runner.run([Req(ps[0], 0, 16, temp, 0, True)])  # warm-up
    k = 0
    for rep in range(args.reps):
        for i, p in enumerate(ps):
            order = ["target_only", "speculative"]
            if k % 2:
                order.reverse()
            k += 1
            got = {}
            for mode in order:
                out = runner.run([Req(p, 0, args.new_tokens, temp, 1000 * rep + i,
                                      mode == "speculative")])[0]
                runs[mode].append(out)
                got[mode] = out.tokens
            if temp == 0 and got["target_only"] != got["speculative"]:
                raise SystemExit("greedy speculative output differs from target-only")
    res: dict[str, Any] = {}
    for mode, outs in runs.items():
        drafted = sum(o.drafted for o in outs)
        looked = sum(o.looked_up for o in outs)
        looked_acc = sum(o.lookup_accepted for o in outs)
        headed = sum(o.head_drafted for o in outs)
        head_acc = sum(o.head_accepted for o in outs)
        model_acc = sum(o.accepted for o in outs) - looked_acc - head_acc
        modeled = drafted - looked - headed
        res[mode] = {"decode_tps": round(statistics.median(o.tps for o in outs), 2),
                     "acceptance": round(sum(o.accepted for o in outs) / drafted, 3)
                     if drafted else None,
                     "lookup_drafted": looked,
                     "lookup_acceptance": round(looked_acc / looked, 3) if looked else None,
                     "head_drafted": headed,
                     "head_acceptance": round(head_acc / headed, 3) if headed else None,
                     "model_drafted": modeled,
                     "model_acceptance": round(model_acc / modeled, 3) if modeled else None,
                     "drafted_per_step": round(drafted / sum(o.steps for o in outs), 3),
                     "tokens_per_pass": round(sum(len(o.tokens) - 1 for o in outs)
                                              / sum(o.steps for o in outs), 3)}
    ratios = [s.tps / t.tps for s, t in zip(runs["speculative"], runs["target_only"],
                                            strict=True)]
    res["speedup_median_of_pairs"] = round(statistics.median(ratios), 3)
    res["speedup_of_medians"] = round(res["speculative"]["decode_tps"]
                                      / res["target_only"]["decode_tps"], 3)
    print(f"single t{temp}: {res}", file=sys.stderr, flush=True)
    return res


def concurrency(runner: EngineRunner | ServiceRunner, ps: list[list[int]], spec: bool,
                args: argparse.Namespace) -> dict[str, Any]:
    """The same four greedy requests one after the other, then on four slots at once,
    interleaved: aggregate tokens per second of wall time."""
    rates: dict[str, list[float]] = {"one_stream": [], "four_streams": []}
    reqs = [Req(p, i, args.new_tokens, 0.0, 0, spec) for i, p in enumerate(ps)]
    warm = [Req(p, i, 8, 0.0, 0, spec) for i, p in enumerate(ps)]
    runner.run(warm[:1])  # warm-up: one stream, then four at once
    runner.run(warm)
    tokens: list[list[int]] | None = None
    for rep in range(args.reps):
        order = ["one_stream", "four_streams"]
        if rep % 2:
            order.reverse()
        for mode in order:
            t0 = time.perf_counter()
            if mode == "one_stream":
                outs = [runner.run([r])[0] for r in reqs]
            else:
                outs = runner.run(reqs)
            rates[mode].append(sum(len(o.tokens) for o in outs) / (time.perf_counter() - t0))
            if tokens is None:
                tokens = [o.tokens for o in outs]
            elif tokens != [o.tokens for o in outs]:
                raise SystemExit("four streams at once generated other tokens than one by one")
    res = {m: round(statistics.median(v), 2) for m, v in rates.items()}
    ratio = statistics.median(f / o for f, o in zip(rates["four_streams"],
                                                   rates["one_stream"], strict=True))
    out = {"tokens_per_s": res, "four_over_one": round(ratio, 3),
           "four_over_one_each_pair": [round(f / o, 3) for f, o in zip(
               rates["four_streams"], rates["one_stream"], strict=True)],
           "tokens_per_stream": [len(t) for t in tokens or []]}
    print(f"concurrent speculative={spec}: {out}", file=sys.stderr, flush=True)
    return out


def decode_run(dec: SpecDecoder, prompt: list[int], n_new: int, sp: SamplingParams,
               spec: SpecParams, seed: int) -> dict[str, float]:
    dec.clear(0)
    dec.seed(0, seed)
    before = dec.counters(0)
    out = [dec.prefill(0, prompt, sp, with_draft=spec.n_max > 0)]
    if spec.head_n_max:  # the head's acceptance alone: lookup stays off in these rows
        assert not spec.lookup
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


def core_path(args: argparse.Namespace) -> dict[str, Any]:
    if args.head:
        return core_head_path(args)
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
        "path": "core",
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


def core_head_path(args: argparse.Namespace) -> dict[str, Any]:
    """--path core with --head: the head alone drafts fixed lengths (--n-max, --p-min),
    target-only beside it; the head attached in every row (it follows each step)."""
    n_ctx = args.prompt_tokens + args.new_tokens + 32
    with Model.load(args.target) as tm, Head(args.head, tm) as hm:
        tc = Context(tm, n_slots=1, n_ctx=n_ctx, n_threads=args.threads)
        hc = Context(hm, n_slots=1, n_ctx=n_ctx, n_threads=1)
        dec = SpecDecoder(tc, None, hc)
        configs = [("target_only", NO_SPEC)] + [
            (f"head_{n}" + (f"_p_min_{p}" if p else ""), SpecParams(n_max=0, p_min=p,
                                                                    head_n_max=n))
            for p in args.p_min for n in args.n_max]
        results: dict[str, Any] = {}
        for domain in args.domains:
            prompts = domain_prompts(tm.tokenizer, domain, args.prompts, args.prompt_tokens)
            results[domain] = run_domain(dec, prompts, configs, args)
        dec.close()
        tc.close()
        hc.close()
    return {"benchmark": "speculative", "path": "core", "target": str(args.target),
            "head": str(args.head), "threads": args.threads, "cpu": machine.cpu_model(),
            "cpu_class": machine.cpu_class(),
            "native": os.environ.get("WARMSLOT_NATIVE", "release"),
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "reps": args.reps, "results": results,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


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
    p.add_argument("--path", choices=("engine", "service", "core"), default="engine")
    p.add_argument("--model", "--target", dest="target", type=Path,
                   default=ROOT / "models" / "target.gguf")
    p.add_argument("--draft", type=lambda v: None if v == "none" else Path(v),
                   default=ROOT / "models" / "draft.gguf", help="a draft model, or none")
    p.add_argument("--head", type=lambda v: None if v == "none" else Path(v), default=None,
                   help="--path engine/service: a feature head (warmslot-head GGUF), or none")
    p.add_argument("--service-flag", action="append", default=[],
                   help="--path service: a flag for the service (e.g. --service-flag="
                        "--spec-p-min=0.3), repeatable")
    p.add_argument("--no-lookup", action="store_true",
                   help="--path engine/service: the draft model alone drafts")
    p.add_argument("--domains", nargs="+", choices=DOMAINS, default=["code"])
    p.add_argument("--n-max", type=int, nargs="+", default=[2, 4, 8], help="--path core")
    p.add_argument("--p-min", type=float, nargs="+", default=[0.0, 0.75],
                   help="--path core: draft confidence thresholds (each with every n_max)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--threads", type=int, default=2, help="target threads")
    p.add_argument("--draft-threads", type=int, default=1, help="draft threads")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency-only", action="store_true",
                   help="--path engine/service: only four streams against one")
    args = p.parse_args()
    try:
        if args.path == "core":
            result = core_path(args)
        else:
            result = product_path(args)
    except (CoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.path == "core":
        if "draft_cost" in result:
            print(f"draft cost: {result['draft_cost']}", file=sys.stderr)
        for domain, temps in result["results"].items():
            for t, per in temps.items():
                for name, r in per.items():
                    print(f"{domain} {t} {name}: {r}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
