"""What session write-through costs: the same session turns on a service with
`--session-write-through` and on one without, alternated round by round.

    .venv/bin/python bench/write_through.py [--sessions 4] [--context 1500] [--rounds 9]

One snapshot service process (a local data directory) and two inference processes on
127.0.0.1, SmolLM2-135M-Instruct with its draft, 4 slots, greedy: "on" writes each
turn's end state to the snapshot service in the background, "off" only on eviction and
at stop. Each builds the same `--sessions` sessions of `--context` tokens (held-out
code), then each round sends one turn per session from concurrent clients (`--new`
new tokens, `--gen` generated), on one service and then the other (the order alternates;
the idle one does nothing, so the two do not share the CPU). Per round and side: the
total generated tokens over the round's wall time, and the medians of the turns' time
to first token and of their whole time; the ratios on/off are medians of the per-round
ratios. The next turn of each session comes right after the previous round, so a write
still in flight competes with it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # corpus, for the prompts

from prompts import code_prompts  # noqa: E402
from service import Service, together  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from inference_svc.core import Model  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402

SIDES = {"on": ("--session-write-through",), "off": ("--no-session-write-through",)}


def one_turn(c: InferenceClient, session: str, prompt: list[int], gen: int,
             out: dict[str, float]) -> None:
    req = make_request(prompt, max_tokens=gen, temperature=0.0, session=session)
    t0 = time.perf_counter()
    first = None
    n = 0
    for r in c.generate_stream(req, timeout=600):
        if r.tokens and first is None:
            first = time.perf_counter()
        n += len(r.tokens)
    t1 = time.perf_counter()
    out.update(ttft=(first or t1) - t0, total=t1 - t0, n=n)


def run_round(c: InferenceClient, side: str, turns: list[list[int]], gen: int) -> dict[str, Any]:
    outs: list[dict[str, float]] = [{} for _ in turns]
    wall = together(len(turns),
                    lambda i: one_turn(c, f"{side}-{i}", turns[i], gen, outs[i]))
    return {"tok_s": sum(o["n"] for o in outs) / wall,
            "ttft_ms": 1e3 * statistics.median(o["ttft"] for o in outs),
            "turn_ms": 1e3 * statistics.median(o["total"] for o in outs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", dest="target", type=Path,
                    default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "smollm2-draft.gguf")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--context", type=int, default=1500, help="tokens of each session's start")
    ap.add_argument("--new", type=int, default=32, help="new prompt tokens per turn")
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    with Model.load(args.target) as model:
        tok = model.tokenizer
        starts = code_prompts(tok, args.sessions, args.context)
        # the turns' new tokens: successive pieces of the held-out files
        pieces = [t[i:i + args.new] for t in code_prompts(tok, 64, 1024)
                  for i in range(0, 1024 - args.new + 1, args.new)]
    news = pieces[:args.sessions * args.rounds]
    if len(starts) < args.sessions or len(news) < args.sessions * args.rounds:
        raise SystemExit("not enough held-out text for these sessions and rounds")
    ns = argparse.Namespace(ctx=args.ctx, threads=args.threads, n_max=8)
    with tempfile.TemporaryDirectory(prefix="write-through-") as tmp:
        snap = ServerProcess(Path(tmp) / "snap")
        svcs = {side: Service(ns, args.target, args.draft, extra=(
            "--snapshot-addr", snap.address, "--instance-id", side, *flags))
            for side, flags in SIDES.items()}
        clients = {side: InferenceClient(f"127.0.0.1:{s.port}", timeout=600)
                   for side, s in svcs.items()}
        rows: list[dict[str, Any]] = []
        try:
            for side, c in clients.items():  # the sessions' first turns, and a warm-up
                c.wait_ready(120)
                run_round(c, side, starts, args.gen)
            for r in range(args.rounds):
                turns = news[r * args.sessions:(r + 1) * args.sessions]
                order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
                row = {side: run_round(clients[side], side, turns, args.gen) for side in order}
                rows.append(row)
        finally:
            for c in clients.values():
                c.close()
            for s in svcs.values():
                s.stop()
            snap.terminate()

    def ratio(key: str) -> float:
        return round(statistics.median(r["on"][key] / r["off"][key] for r in rows), 4)

    def med(side: str, key: str) -> float:
        return round(statistics.median(r[side][key] for r in rows), 2)

    out = {"sessions": args.sessions, "context": args.context, "new": args.new,
           "gen": args.gen, "rounds": args.rounds, "threads": args.threads,
           "on_over_off": {k: ratio(k) for k in ("tok_s", "ttft_ms", "turn_ms")},
           "medians": {side: {k: med(side, k) for k in ("tok_s", "ttft_ms", "turn_ms")}
                       for side in SIDES},
           "rounds_raw": rows}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
