"""The HTTP door against gRPC: the same streamed request through both, and a load of many
concurrent streaming clients.

    python bench/http_door.py [--model PATH] [--draft PATH|none] [--reps 7]
                         [--prompt-tokens 128] [--gen 128] [--clients 64] [--load-gen 32]

The service runs as its own process (`python -m inference_svc --http-port 0`, 4 slots) on
127.0.0.1. Every request is the same token-id prompt, greedy, on a fixed slot without
prompt reuse (`id_slot`, `cache_prompt: false`), so both doors do the same work:

- one stream, then four streams at once (one per slot): gRPC (`InferenceClient`), HTTP read
  with the standard library (`http.client`, SSE lines parsed with `json`), and HTTP through
  the official `openai` client, in a rotating order each repetition (A/B/C interleaved,
  warmed up first). Per request: tokens/s from sending it to its last token as the client
  sees it, and the time to its first text. Ratios are medians of the per-repetition ratios
  to gRPC; the added time to first token is the median of the per-repetition differences.
  Every side must produce the same text;
- `--clients` streaming `openai` clients at once on the 4 slots (the rest queue, within
  `--max-queue` 64), each request bounded (`--load-gen` tokens, a 300 s client timeout):
  errors counted by type, every stream checked to end with a finish_reason and its usage.

The last line printed is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

import openai  # noqa: E402
from machine import commit_of_repo, cpu_class, cpu_model, cpu_seconds  # noqa: E402
from service import Service, together  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.core import Model  # noqa: E402

SLOTS = 4


def start_service(args: argparse.Namespace) -> Service:
    """The service with its HTTP door on a free port; `.model`: the door's model id."""
    draft = None if args.draft == "none" else Path(args.draft)
    svc = Service(argparse.Namespace(ctx=args.ctx, threads=args.threads, n_max=8),
                  args.model, draft, extra=("--http-port", "0", "--no-auto-save"))
    if not svc.http_port:
        svc.stop()
        raise SystemExit("the service did not open its HTTP door")
    svc.model = args.model.name.removesuffix(".gguf")  # type: ignore[attr-defined]
    return svc


def body(prompt: list[int], n: int, slot: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": n, "temperature": 0, "id_slot": slot,
            "cache_prompt": False, "stream": True, "stream_options": {"include_usage": True}}


def result(t0: float, first: float, t1: float, text: list[str], tokens: int,
           timings: dict[str, Any]) -> dict[str, Any]:
    """A request's figures; `overhead`: the client's time beyond the engine's own for the
    request (waiting, prompt, decoding), `first_overhead`: its time to the first text beyond
    the engine's time to the first token; both leave out the engine's speed, which a
    shared machine makes noisy, and keep what the door, the network and the client add."""
    engine = 1e-3 * (timings["queue_ms"] + timings["prompt_ms"] + timings["predicted_ms"])
    to_first = 1e-3 * (timings["queue_ms"] + timings["prompt_ms"])
    return {"rate": tokens / (t1 - t0), "ttft": first - t0, "text": "".join(text),
            "n": tokens, "overhead": (t1 - t0) - engine, "first_overhead": (first - t0) - to_first}


def via_grpc(svc: Service, prompt: list[int], n: int, slot: int) -> dict[str, Any]:
    with InferenceClient(f"127.0.0.1:{svc.port}", timeout=600) as c:
        req = make_request(prompt, max_tokens=n, id_slot=slot, cache_prompt=False,
                           temperature=0.0)
        t0 = time.perf_counter()
        first = 0.0
        text, tokens = [], 0
        timings: dict[str, Any] = {}
        for r in c.generate_stream(req):
            if r.text and not first:
                first = time.perf_counter()
            text.append(r.text)
            tokens += len(r.tokens)
            if r.done:
                timings = {f.name: getattr(r.timings, f.name) for f in r.timings.DESCRIPTOR.fields}
        t1 = time.perf_counter()
    return result(t0, first, t1, text, tokens, timings)


def via_http(svc: Service, prompt: list[int], n: int, slot: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", svc.http_port, timeout=600)
    data = json.dumps({"model": svc.model, **body(prompt, n, slot)})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    first = 0.0
    text, tokens = [], 0
    timings: dict[str, Any] = {}
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"]:
            if not first:
                first = time.perf_counter()
            text.append(chunk["choices"][0]["text"])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if "timings" in chunk:
            timings = chunk["timings"]
    t1 = time.perf_counter()
    conn.close()
    return result(t0, first, t1, text, tokens, timings)


def via_openai(svc: Service, prompt: list[int], n: int, slot: int) -> dict[str, Any]:
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http_port}/v1", api_key="x",
                       max_retries=0,
                       timeout=600)
    b = body(prompt, n, slot)
    extra = {"id_slot": b.pop("id_slot"), "cache_prompt": b.pop("cache_prompt")}
    t0 = time.perf_counter()
    first = 0.0
    text, tokens = [], 0
    timings: dict[str, Any] = {}
    for chunk in oa.completions.create(model=svc.model, extra_body=extra, **b):
        if chunk.choices and chunk.choices[0].text:
            if not first:
                first = time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if (chunk.model_extra or {}).get("timings"):
            timings = chunk.model_extra["timings"]  # type: ignore[index]
    t1 = time.perf_counter()
    oa.close()
    return result(t0, first, t1, text, tokens, timings)


SIDES = {"grpc": via_grpc, "http": via_http, "openai": via_openai}


def run_streams(side: str, svc: Service, ps: list[list[int]], n: int) -> dict[str, Any]:
    """len(ps) requests at once, one per slot: total tokens / wall time, each one's
    result, and the CPU time the server and this client process spent per token (the
    two share the machine's cores, so a client that parses more takes from the engine)."""
    out: list[dict[str, Any]] = [{} for _ in ps]

    def one(i: int) -> None:
        out[i] = SIDES[side](svc, ps[i], n, i)

    server0, client0 = cpu_seconds(svc.p.pid), cpu_seconds(os.getpid())
    wall = together(len(ps), one)
    tokens = sum(r["n"] for r in out)
    server = cpu_seconds(svc.p.pid) - server0
    client = cpu_seconds(os.getpid()) - client0
    return {"rate": tokens / wall, "server_cpu": server / tokens, "client_cpu": client / tokens,
            "ttft": statistics.median(r["ttft"] for r in out),
            "overhead": statistics.median(r["overhead"] for r in out),
            "first_overhead": statistics.median(r["first_overhead"] for r in out),
            "texts": [r["text"] for r in out]}


def compare(svc: Service, ps: list[list[int]], n: int, reps: int) -> dict[str, Any]:
    for side in SIDES:  # warm-up
        run_streams(side, svc, ps, n)
    rows: list[dict[str, dict[str, Any]]] = []
    order = list(SIDES)
    for rep in range(reps):
        row = {}
        for side in order[rep % 3:] + order[:rep % 3]:
            row[side] = run_streams(side, svc, ps, n)
        assert row["http"]["texts"] == row["grpc"]["texts"] == row["openai"]["texts"], \
            "the doors gave different text"
        rows.append(row)
    out: dict[str, Any] = {"streams": len(ps), "reps": reps}
    for side in SIDES:
        out[f"{side}_overhead_ms"] = round(1e3 * statistics.median(
            r[side]["overhead"] for r in rows), 2)
        out[f"{side}_tokens_per_s"] = round(statistics.median(r[side]["rate"] for r in rows), 1)
        out[f"{side}_ttft_ms"] = round(1e3 * statistics.median(r[side]["ttft"] for r in rows), 2)
        for who in ("server", "client"):
            out[f"{side}_{who}_cpu_ms_per_token"] = round(1e3 * statistics.median(
                r[side][f"{who}_cpu"] for r in rows), 3)
    for side in ("http", "openai"):
        out[f"{side}_over_grpc"] = round(statistics.median(
            r[side]["rate"] / r["grpc"]["rate"] for r in rows), 3)
        out[f"{side}_added_ttft_ms"] = round(1e3 * statistics.median(
            r[side]["ttft"] - r["grpc"]["ttft"] for r in rows), 2)
        # the same without the engine's time (see result()): what the door itself adds
        out[f"{side}_added_overhead_ms"] = round(1e3 * statistics.median(
            r[side]["overhead"] - r["grpc"]["overhead"] for r in rows), 2)
        out[f"{side}_added_first_overhead_ms"] = round(1e3 * statistics.median(
            r[side]["first_overhead"] - r["grpc"]["first_overhead"] for r in rows), 2)
    return out


def load(svc: Service, ps: list[list[int]], clients: int, n: int) -> dict[str, Any]:
    """`clients` streaming openai clients at once; errors by type, malformed streams."""
    errors: Counter[str] = Counter()
    malformed: list[str] = []
    tokens = [0] * clients

    def one(i: int) -> None:
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http_port}/v1", api_key="x",
                           max_retries=0, timeout=300)
        try:
            finish, usage = None, None
            for chunk in oa.completions.create(
                    model=svc.model, prompt=ps[i % len(ps)], max_tokens=n,
                    temperature=0.8, seed=i, stream=True,
                    stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
            if finish not in ("stop", "length") or usage is None:
                malformed.append(f"client {i}: finish {finish}, usage {usage}")
            else:
                tokens[i] = usage.completion_tokens
        except openai.APIStatusError as exc:
            errors[f"{exc.status_code} {exc.body.get('code') if isinstance(exc.body, dict) else ''}"] += 1  # noqa: E501
        except Exception as exc:  # noqa: BLE001 - counted
            errors[type(exc).__name__] += 1
        finally:
            oa.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - t0
    return {"clients": clients, "slots": SLOTS, "max_tokens": n, "wall_s": round(wall, 2),
            "completed": sum(1 for t in tokens if t), "tokens": sum(tokens),
            "tokens_per_s": round(sum(tokens) / wall, 1), "errors": dict(errors),
            "malformed": malformed, "hung": sum(t.is_alive() for t in threads)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft.gguf"))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--load-gen", type=int, default=32)
    args = ap.parse_args()
    with Model.load(args.model) as m:
        text = "\n".join(f"def scale_{i}(values, factor={i}):\n    # multiply every value\n"
                         f"    return [v * factor + {i % 7} for v in values if v > {i % 5}]"
                         for i in range(200))
        toks = m.tokenizer.encode(text)
    ps = [toks[i * 97:i * 97 + args.prompt_tokens] for i in range(SLOTS)]
    svc = start_service(args)
    try:
        result = {
            "bench": "http", "cpu": cpu_model(), "cpu_class": cpu_class(),
            "kernels": os.environ.get("WARMSLOT_NATIVE", "release"),
            "load_average": os.getloadavg(), "commit": commit_of_repo(),
            "model": args.model.name, "draft": Path(args.draft).name,
            "prompt_tokens": args.prompt_tokens, "gen": args.gen, "threads": args.threads,
            "one_stream": compare(svc, ps[:1], args.gen, args.reps),
            "four_streams": compare(svc, ps, args.gen, args.reps),
            "load": load(svc, ps, args.clients, args.load_gen),
        }
    finally:
        svc.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
