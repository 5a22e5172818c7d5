"""Sessions benchmark: more conversations than slots, each turn continuing its session
from the slot, the RAM tier or the store, against re-prefilling the conversation.

    .venv/bin/python bench/sessions.py [--slots 4] [--sessions 32] [--tokens 1500]
        [--turns 6] [--clients 8] [--new 48] [--gen 32] [--threads 2]
        [--tiers ram,store] [--no-reference] [--kv-type f16] [--session-ram-mb MB]

SmolLM2-135M-Instruct with its draft (models/), speculative decoding at temperature 0,
every service a real process on 127.0.0.1. `--sessions` conversations start with
`--tokens` tokens of text each (this repository's sources, a different place for each)
and then take `--turns` - 1 more turns of `--new` new tokens each; every turn generates
`--gen` tokens. `--clients` threads send the turns, each owning every clients-th
session and taking its sessions round-robin, a turn at a time.

Servers, all with `--slots` slots and the same context:
- ram:   sessions in the RAM tier when they leave their slot (`--session-ram-mb` big
         enough for all of them, or the given MB: then the least recently used go on
         to the store), a local directory as the store;
- store: `--session-ram-mb 0`: a session leaving its slot goes to the local directory;
- reprefill: no sessions: each turn sends the whole conversation so far (the session's
         earlier prompts and outputs, taken from the run) with cache_prompt false, the
         work a server without sessions does once the conversation lost its slot;
- reference (unless --no-reference): a slot per session, nothing ever evicted.

The runs interleave by turn: turn t of every session on `ram`, then on `store`, then
the same turn on `reprefill` (turn 0, the first prefill, is the same work everywhere
and not timed against it). The reference runs first.

Checked, listed under "anomalies" when wrong: every turn after the first processes
exactly its new tokens (prompt_n), its output equals the reference's and the
re-prefill's, and its speculative counts (drafted, accepted, draft catch-up) equal the
reference's. Reported: client-side time to first token (request sent -> first token)
of turns 1.. by the tier the session came from, medians and the ratio of the
re-prefill's median to it. Every server keeps its KV in `--kv-type`; after the last
turn, the sessions the ram server holds in each tier (ListSessions): at a given
`--session-ram-mb`, how many sessions the RAM tier holds for that KV type. The last
line printed is one JSON object.

Targets: TTFT at least 5x faster than re-prefilling, for the RAM and the store tier.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference_svc.client import make_request  # noqa: E402
from inference_svc.core import Model  # noqa: E402
from inference_svc.pb import inference_pb2 as pb  # noqa: E402
from tests.resumekit import InferenceProcess, source_tokens  # noqa: E402

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT = ROOT / "models" / "smollm2-draft.gguf"
TARGET_SPEEDUP = 5.0
TURN_TIMEOUT_S = 3600.0
N_MAX = 8
# the draft proposes n_max tokens at every step: acceptance is compared on every turn
# (the SmolLM2 draft rarely reaches the service's default confidence of 0.75)
P_MIN = 0.0
TIER = {pb.SESSION_TIER_NEW: "new", pb.SESSION_TIER_SLOT: "slot",
        pb.SESSION_TIER_RAM: "ram", pb.SESSION_TIER_STORE: "store"}


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--slots", type=int, default=4)
    a("--sessions", type=int, default=32)
    a("--tokens", type=int, default=1500, help="tokens of a session's first turn")
    a("--turns", type=int, default=6)
    a("--clients", type=int, default=8)
    a("--new", type=int, default=48, help="new tokens of each later turn")
    a("--gen", type=int, default=32, help="tokens generated per turn")
    a("--threads", type=int, default=2)
    a("--tiers", default="ram,store", help="session servers to run: ram, store or both")
    a("--no-reference", action="store_true", help="skip the server with a slot per session")
    a("--model", type=Path, default=MODEL)
    a("--draft", type=Path, default=DRAFT)
    a("--kv-type", default="f16", help="every server's --kv-type")
    a("--session-ram-mb", type=int, default=0,
      help="the ram server's RAM tier; 0: enough for every session")
    return p.parse_args()


class Run:
    """One server and the turns it served: (session, turn) -> result."""

    def __init__(self, name: str, proc: InferenceProcess, sessions: bool) -> None:
        self.name = name
        self.proc = proc
        self.sessions = sessions
        self.results: dict[tuple[int, int], dict[str, Any]] = {}

    def turn(self, s: int, t: int, prompt: list[int], gen: int) -> dict[str, Any]:
        if self.sessions:
            req = make_request(prompt, max_tokens=gen, temperature=0.0, speculative=True,
                               n_max=N_MAX, p_min=P_MIN, session=f"bench-{s}")
        else:
            req = make_request(prompt, max_tokens=gen, temperature=0.0, speculative=True,
                               n_max=N_MAX, p_min=P_MIN, cache_prompt=False)
        out: list[int] = []
        first = last = None
        t0 = time.perf_counter()
        # the turns queue behind each other (more clients than slots): the bound is the
        # servers' --max-queue-wait, not the client library's default deadline
        for resp in self.proc.client.generate_stream(req, timeout=TURN_TIMEOUT_S):
            if first is None and resp.tokens:
                first = time.perf_counter()
            out += list(resp.tokens)
            last = resp
        end = time.perf_counter()
        assert last is not None and last.done
        tm = last.timings
        res = {"ttft_ms": 1e3 * ((first or end) - t0), "prompt_n": tm.prompt_n,
               "cache_n": tm.cache_n, "tier": TIER.get(tm.session_tier, "none"),
               "restore_ms": tm.session_restore_ms, "draft_n": tm.draft_n,
               "draft_n_accepted": tm.draft_n_accepted, "draft_prompt_n": tm.draft_prompt_n,
               "tokens": out}
        self.results[(s, t)] = res
        return res


def run_turn(run: Run, t: int, n_sessions: int, n_clients: int,
             prompt_of: Any, gen: int) -> None:
    """Turn t of every session, sent by n_clients threads (client c: sessions c, c +
    n_clients, ...), each taking its sessions in order."""
    errors: list[BaseException] = []

    def client(c: int) -> None:
        try:
            for s in range(c, n_sessions, n_clients):
                run.turn(s, t, prompt_of(s, t), gen)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def main() -> None:
    a = args()
    tiers = [x for x in a.tiers.split(",") if x]
    ctx = a.tokens + (a.turns - 1) * a.new + a.turns * a.gen + 16
    per_token = 0  # K+V bytes per token of the target and the draft in --kv-type
    for path in (a.model, a.draft):
        with Model.load(path) as m:
            per_token += m.kv_bytes_per_token(a.kv_type)
    ram_mb = a.session_ram_mb or a.sessions * ctx * per_token // (1 << 20) + 64
    work = Path(tempfile.mkdtemp(prefix="warmslot-bench-sessions-"))
    common = ("--model", str(a.model), "--draft", str(a.draft), "--ctx", str(ctx),
              "--kv-type", a.kv_type,
              "--threads", str(a.threads), "--no-auto-save", "--stream-interval-ms", "0",
              "--max-queue-wait", str(int(TURN_TIMEOUT_S)), "--max-queue", str(4 * a.clients))
    procs: list[InferenceProcess] = []
    anomalies: list[str] = []
    t_start = time.time()
    try:
        def start(name: str, *extra: str) -> InferenceProcess:
            p = InferenceProcess(*common, *extra, start_timeout=600)
            procs.append(p)
            print(f"[{name}] serving on {p.port}", file=sys.stderr)
            return p

        first = start("reprefill", "--slots", str(a.slots))
        src = source_tokens(first, a.tokens + 4096)
        stride = max(1, (len(src) - a.tokens) // max(a.sessions, 1))

        def firsts(s: int) -> list[int]:
            return src[s * stride % (len(src) - a.tokens):][:a.tokens]

        def new_of(s: int, t: int) -> list[int]:
            at = (s * 7919 + t * 104729) % (len(src) - a.new)
            return src[at:at + a.new]

        def prompt_of(s: int, t: int) -> list[int]:
            return firsts(s) if t == 0 else new_of(s, t)

        runs: dict[str, Run] = {"reprefill": Run("reprefill", first, sessions=False)}
        for tier in tiers:
            ram = str(ram_mb) if tier == "ram" else "0"
            runs[tier] = Run(tier, start(tier, "--slots", str(a.slots), "--session-ram-mb",
                                         ram, "--slot-save-path", str(work / tier)), True)
        ref: Run | None = None
        if not a.no_reference:
            ref = Run("reference", start("reference", "--slots", str(a.sessions),
                                         "--session-ram-mb", "0"), True)
            for t in range(a.turns):
                run_turn(ref, t, a.sessions, a.clients, prompt_of, a.gen)
            print("[reference] done", file=sys.stderr)

        def history(run: Run, s: int, t: int) -> list[int]:
            """The conversation before turn t plus its new tokens, as `run` produced it."""
            out: list[int] = []
            for u in range(t):
                out += prompt_of(s, u) + run.results[(s, u)]["tokens"]
            return out + prompt_of(s, t)

        base_src = runs[tiers[0]] if tiers else ref
        for t in range(a.turns):
            for tier in tiers:
                run_turn(runs[tier], t, a.sessions, a.clients, prompt_of, a.gen)
            if t > 0 and base_src is not None:
                run_turn(runs["reprefill"], t, a.sessions, a.clients,
                         lambda s, u: history(base_src, s, u), a.gen)  # type: ignore[arg-type]
            print(f"turn {t} done ({time.time() - t_start:.0f} s)", file=sys.stderr)

        report: dict[str, Any] = {}
        base = runs["reprefill"]
        for tier in tiers:
            run = runs[tier]
            by_tier: dict[str, list[float]] = {}
            paired: dict[str, list[float]] = {}
            wrong_prompt_n = wrong_output = wrong_spec = 0
            for (s, t), r in sorted(run.results.items()):
                if t == 0:
                    continue
                if r["prompt_n"] != len(prompt_of(s, t)):
                    wrong_prompt_n += 1
                b = base.results.get((s, t))
                if b is not None and b["tokens"] != r["tokens"]:
                    wrong_output += 1
                if ref is not None:
                    g = ref.results[(s, t)]
                    if g["tokens"] != r["tokens"]:
                        wrong_output += 1
                    if [g[k] for k in ("draft_n", "draft_n_accepted", "draft_prompt_n")] != \
                            [r[k] for k in ("draft_n", "draft_n_accepted", "draft_prompt_n")]:
                        wrong_spec += 1
                by_tier.setdefault(r["tier"], []).append(r["ttft_ms"])
                if b is not None:
                    paired.setdefault(r["tier"], []).append(b["ttft_ms"] / r["ttft_ms"])
            for what, n in (("prompt_n != new tokens", wrong_prompt_n),
                            ("output differs", wrong_output),
                            ("speculative counts differ from the never-evicted run", wrong_spec)):
                if n:
                    anomalies.append(f"{tier}: {n} turns: {what}")
            report[tier] = {
                "turns_by_tier": {k: len(v) for k, v in sorted(by_tier.items())},
                "ttft_ms_median_by_tier": {k: med(v) for k, v in sorted(by_tier.items())},
                "ttft_ms_median": med([x for v in by_tier.values() for x in v]),
                "speedup_median_paired_by_tier": {k: med(v) for k, v in sorted(paired.items())},
                "restore_ms_median_by_tier": {
                    k: med([r["restore_ms"] for (s, t), r in run.results.items()
                            if t > 0 and r["tier"] == k]) for k in sorted(by_tier)},
                "drafted_after_turn_0": sum(r["draft_n"] for (s, t), r in run.results.items()
                                            if t > 0),
                "accepted_after_turn_0": sum(r["draft_n_accepted"]
                                             for (s, t), r in run.results.items() if t > 0),
            }
        base_ttft = [r["ttft_ms"] for (s, t), r in base.results.items() if t > 0]
        report["reprefill"] = {"ttft_ms_median": med(base_ttft), "turns": len(base_ttft)}
        for tier in tiers:
            m = report[tier]["ttft_ms_median_by_tier"].get(tier)
            report[tier]["speedup_of_median"] = (round(med(base_ttft) / m, 2)
                                                 if m and base_ttft else None)
            report[tier]["target_met"] = bool(report[tier]["speedup_of_median"]
                                              and report[tier]["speedup_of_median"]
                                              >= TARGET_SPEEDUP)
        if ref is not None:
            report["reference"] = {
                "drafted_after_turn_0": sum(r["draft_n"] for (s, t), r in ref.results.items()
                                            if t > 0),
                "accepted_after_turn_0": sum(r["draft_n_accepted"]
                                             for (s, t), r in ref.results.items() if t > 0)}
        for tier in tiers:  # where each server holds its sessions after the last turn
            held: dict[str, int] = {}
            for info in runs[tier].proc.client.sessions():
                held[TIER.get(info.tier, "none")] = held.get(TIER.get(info.tier, "none"), 0) + 1
            report[tier]["sessions_by_tier_at_end"] = dict(sorted(held.items()))
        out = {"bench": "sessions", "model": a.model.name, "draft": a.draft.name,
               "slots": a.slots, "sessions": a.sessions, "tokens": a.tokens,
               "turns": a.turns, "clients": a.clients, "new": a.new, "gen": a.gen,
               "ctx": ctx, "threads": a.threads, "kv_type": a.kv_type, "ram_tier_mb": ram_mb,
               "seconds": round(time.time() - t_start, 1), **report,
               "anomalies": anomalies}
        print(json.dumps(out))
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
