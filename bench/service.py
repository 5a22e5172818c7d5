"""Inference-service benchmark: tokens/s through gRPC against the core called directly.

    python bench/service.py [--model PATH] [--draft PATH|none] [--reps 5]
                            [--prompt-tokens 256] [--gen 128] [--threads 2]

The service runs as its own process (`python -m inference_svc`, 4 slots) on
127.0.0.1; the direct runs use the same models, context size, threads and
speculative settings in this process. Same prompts on both sides, greedy.

- one stream: A/B interleaved (core and service in a rotating order), medians of
  the end-to-end rate (tokens over the time from sending the request to the
  last token, as the client sees it; for the core: from the call to the last
  token) and of the decode rate (tokens after the first, over the decoding
  time; the service's is its own `predicted_per_second`, since the client sees
  tokens in batches). Both sides must produce the same tokens; requests stop
  at EOS on both;
- four streams on four slots: total tokens over the wall time, for the service
  (four concurrent clients) and for the core (the same round robin in one thread).

The ratios are medians of the per-repetition ratios (each pair runs back to back),
which a machine shared with other work disturbs less than a ratio of medians.

Without the bundled models (models/target.gguf, models/draft.gguf) it uses
random models of the same shapes. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.core import Context, Model  # noqa: E402
from inference_svc.core.speculative import (  # noqa: E402
    NO_SPEC,
    SamplingParams,
    SpecDecoder,
    SpecParams,
)

GREEDY = SamplingParams()
SLOTS = 4


def stand_in_models(directory: Path) -> tuple[Path, Path]:
    """Random models with the bundled pair's shapes (tools/train_models.py)."""
    from tests.factory import Shape, write_model

    t, d = directory / "target.gguf", directory / "draft.gguf"
    write_model(t, Shape(n_vocab=2048, n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=688,
                         n_ctx=4096), seed=1)
    write_model(d, Shape(n_vocab=2048, n_embd=128, n_layer=1, n_head=4, n_head_kv=2, n_ff=352,
                         n_ctx=4096), seed=1)
    return t, d


def prompts(model: Model, n_tokens: int, count: int) -> list[list[int]]:
    """`count` different prompts of n_tokens each, from fixed code-like text."""
    text = "\n".join(f"def scale_{i}(values, factor={i}):\n    # multiply every value\n"
                     f"    return [v * factor + {i % 7} for v in values if v > {i % 5}]\n"
                     for i in range(40 * (1 + n_tokens * count // 1000)))
    toks = model.tokenizer.encode(text)
    step = max(1, (len(toks) - n_tokens) // count)
    return [toks[i * step:i * step + n_tokens] for i in range(count)]


class Service:
    """`python -m inference_svc` on a free port, its stderr drained in a thread."""

    def __init__(self, args: argparse.Namespace, target: Path, draft: Path | None,
                 extra: tuple[str, ...] = ()) -> None:
        self.launch(ROOT, ("--model", str(target), "--draft", str(draft) if draft else "none",
                           "--slots", str(SLOTS), "--ctx", str(args.ctx),
                           "--threads", str(args.threads), "--spec-n-max", str(args.n_max),
                           *extra))

    @classmethod
    def of_tree(cls, tree: Path, flags: Sequence[str]) -> Service:
        """The service of a checkout (its sources and native build: cwd and PYTHONPATH)
        with only `flags` besides the address and the log format."""
        svc = cls.__new__(cls)
        svc.launch(tree, flags)
        return svc

    def launch(self, tree: Path, flags: Sequence[str]) -> None:
        cmd = [sys.executable, "-m", "inference_svc", "--port", "0", "--host", "127.0.0.1",
               "--log-format", "json", *flags]
        self.p = subprocess.Popen(cmd, cwd=tree, stderr=subprocess.PIPE, text=True,
                                  stdout=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONPATH": str(tree)})
        self.port = 0
        self.http_port = 0  # with --http-port among the flags
        ready = threading.Event()

        def drain() -> None:
            assert self.p.stderr is not None
            for line in self.p.stderr:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("msg") == "listening":
                    self.port = int(rec["port"])
                    self.http_port = int(rec.get("http_port") or 0)
                if rec.get("msg") in ("serving", "cannot start"):
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(120) or not self.port or self.p.poll() is not None:
            self.p.kill()
            self.p.wait(30)
            raise SystemExit(f"the service of {tree} did not start")

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait(30)


def core_single(dec: SpecDecoder, prompt: list[int], n: int, spec: SpecParams,
                eos: int) -> dict[str, Any]:
    """One request the way the engine runs it (stopping at EOS), without the service."""
    dec.clear(0)
    t0 = time.perf_counter()
    out = [dec.prefill(0, prompt, GREEDY, with_draft=spec.n_max > 0)]
    t1 = time.perf_counter()
    while len(out) < n and eos not in out:
        out += dec.step(0, GREEDY, spec, n - len(out))
    dec.commit(0)
    t2 = time.perf_counter()
    out = out[:out.index(eos)] if eos in out else out
    return {"e2e": len(out) / (t2 - t0), "decode": (len(out) - 1) / (t2 - t1),
            "prefill": len(prompt) / (t1 - t0), "n": len(out), "tokens": out}


def service_single(c: InferenceClient, prompt: list[int], n: int,
                   spec: SpecParams) -> dict[str, Any]:
    req = make_request(prompt, max_tokens=n, id_slot=0, cache_prompt=False, temperature=0.0,
                       speculative=spec.n_max > 0, n_max=spec.n_max or None)
    t0 = time.perf_counter()
    tokens: list[int] = []
    last = None
    for r in c.generate_stream(req):
        tokens += r.tokens
        last = r
    t2 = time.perf_counter()
    assert last is not None and last.done
    return {"e2e": len(tokens) / (t2 - t0), "decode": last.timings.predicted_per_second,
            "prefill": last.timings.prompt_per_second, "n": len(tokens), "tokens": tokens}


def core_multi(dec: SpecDecoder, ps: list[list[int]], n: int, spec: SpecParams,
               eos: int) -> float:
    """The engine's round robin over four slots, without the service."""
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i, p in enumerate(ps):
        dec.clear(i)
        outs.append([dec.prefill(i, p, GREEDY, with_draft=spec.n_max > 0)])
    active = list(range(len(ps)))
    while active:
        for i in list(active):
            if len(outs[i]) < n and eos not in outs[i]:
                outs[i] += dec.step(i, GREEDY, spec, n - len(outs[i]))
            if len(outs[i]) >= n or eos in outs[i]:
                dec.commit(i)
                active.remove(i)
    n_out = sum(len(o[:o.index(eos)] if eos in o else o) for o in outs)
    return n_out / (time.perf_counter() - t0)


def together(n: int, fn: Callable[[int], None]) -> float:
    """fn(0) .. fn(n - 1) on a thread each, started together: the wall seconds until all
    have ended. The first exception one of them raised is raised here."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def service_multi(port: int, ps: list[list[int]], n: int, spec: SpecParams) -> float:
    counts = [0] * len(ps)

    def run(i: int) -> None:
        with InferenceClient(f"127.0.0.1:{port}", timeout=600) as c:
            req = make_request(ps[i], max_tokens=n, id_slot=i, cache_prompt=False,
                               temperature=0.0, speculative=spec.n_max > 0,
                               n_max=spec.n_max or None)
            for r in c.generate_stream(req):
                counts[i] += len(r.tokens)

    wall = together(len(ps), run)
    return sum(counts) / wall


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "target.gguf")
    ap.add_argument("--draft", default=str(ROOT / "models" / "draft.gguf"),
                    help="draft model, or 'none'")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--threads", type=int, default=1,
                    help="decoding threads on both sides (default 1: on a small machine "
                         "shared with other work, the core's spinning barriers make 2-thread "
                         "timings swing widely)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--n-max", type=int, default=None,
                    help="speculative draft length (default 8 with a draft, else 0)")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    target = args.model
    draft: Path | None = None if args.draft == "none" else Path(args.draft)
    stand_in = not target.exists() or (draft is not None and not draft.exists())
    if stand_in:
        target, draft = stand_in_models(Path(tmp.name))
    if args.n_max is None:
        args.n_max = 8 if draft is not None else 0
    spec = SpecParams(n_max=args.n_max) if args.n_max > 0 else NO_SPEC

    svc = Service(args, target, draft)
    tm = Model.load(target)
    dm = Model.load(draft) if draft is not None else None
    tc = Context(tm, n_slots=SLOTS, n_ctx=args.ctx, n_threads=args.threads)
    dc = Context(dm, n_slots=SLOTS, n_ctx=args.ctx, n_threads=args.threads) if dm else None
    dec = SpecDecoder(tc, dc)
    ps = prompts(tm, args.prompt_tokens, SLOTS)
    eos = tm.tokenizer.eos_id if tm.tokenizer.eos_id is not None else -1
    core1: list[dict[str, Any]] = []
    svc1: list[dict[str, Any]] = []
    core4: list[float] = []
    svc4: list[float] = []
    try:
        with InferenceClient(f"127.0.0.1:{svc.port}", timeout=600) as c:
            service_single(c, ps[0], 8, spec)  # warm-up
            core_single(dec, ps[0], 8, spec, eos)
            for rep in range(args.reps):  # each repetition runs all four, in a rotating order
                p = ps[rep % SLOTS]
                runs = {
                    "core1": lambda p=p: core1.append(core_single(dec, p, args.gen, spec, eos)),
                    "svc1": lambda p=p: svc1.append(service_single(c, p, args.gen, spec)),
                    "core4": lambda: core4.append(core_multi(dec, ps, args.gen, spec, eos)),
                    "svc4": lambda: svc4.append(service_multi(svc.port, ps, args.gen, spec)),
                }
                order = list(runs)
                order = order[rep % 4:] + order[:rep % 4]
                for name in order if rep % 2 == 0 else reversed(order):
                    runs[name]()
                if core1[-1]["tokens"] != svc1[-1]["tokens"]:
                    raise SystemExit("the service and the core generated different tokens")
    finally:
        svc.stop()
        dec.close()
        for obj in (dc, tc, dm, tm):
            if obj is not None:
                obj.close()
        tmp.cleanup()

    r: dict[str, Any] = {
        "bench": "service",
        "models": "random stand-ins (bundled models missing)" if stand_in else "bundled",
        "target": tm.name, "draft": dm.name if dm else None, "spec_n_max": spec.n_max,
        "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen,
        "reps": args.reps, "cpu": platform.processor() or platform.machine(),
        "one_stream": {
            "core_e2e_tps": median(core1, "e2e"), "service_e2e_tps": median(svc1, "e2e"),
            "core_decode_tps": median(core1, "decode"),
            "service_decode_tps": median(svc1, "decode"),
            "tokens_per_request": median(core1, "n"),
            "core_prefill_tps": median(core1, "prefill"),
            "service_prefill_tps": median(svc1, "prefill"),
        },
        "four_streams": {"core_total_tps": statistics.median(core4),
                         "service_total_tps": statistics.median(svc4)},
    }
    pairs = list(zip(core1, svc1, strict=True))
    r["ratios"] = {
        "service_vs_core_decode_1": statistics.median(s["decode"] / c["decode"]
                                                      for c, s in pairs),
        "service_vs_core_e2e_1": statistics.median(s["e2e"] / c["e2e"] for c, s in pairs),
        "service_vs_core_total_4": statistics.median(
            s / c for c, s in zip(core4, svc4, strict=True)),
        "service_4_vs_1": statistics.median(
            s4 / s["e2e"] for s4, s in zip(svc4, svc1, strict=True)),
        "core_4_vs_1": statistics.median(c4 / c["e2e"] for c4, c in zip(core4, core1,
                                                                           strict=True)),
    }
    r["targets"] = {
        "one_stream_at_least_90pct_of_core": r["ratios"]["service_vs_core_e2e_1"] >= 0.9,
        "four_streams_at_least_one_stream": r["ratios"]["service_4_vs_1"] >= 1.0,
    }
    for k, v in r["one_stream"].items():
        print(f"1 stream  {k:32s} {v:10.1f}")
    for k, v in r["four_streams"].items():
        print(f"4 streams {k:32s} {v:10.1f}")
    for k, v in r["ratios"].items():
        print(f"ratio     {k:32s} {v:10.3f}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
