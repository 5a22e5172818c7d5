"""Sessions through the router: session-affine (x-session-id hashed) against round-robin
routing over the same replicas, then a replica killed mid-round (bench/router.py).

    .venv/bin/python bench/router.py [--replicas 3] [--slots 4] [--sessions 48]
        [--tokens 1500] [--clients 8] [--turns 4] [--new 40] [--gen 16] [--toy]
        [--out docs/results/router.json]

Processes on 127.0.0.1: one snapshot service, --replicas inference replicas
(`python -m inference_svc`, --slots slots, 1 thread each, write-through and
--session-ack-stored on, --ram-mb of RAM tier, SmolLM2 and its draft; --toy: the bundled
toy pair), and two
HAProxy processes configured by deploy/router.py over the same replicas: `session`
(x-session-id hashed consistently, the compose router) and `roundrobin` (every request to
the next replica, the session ignored). Each side has its own --sessions sessions with the
same token content.

Turn 0 of every session sends --tokens tokens (the warm-up: both sides prefill the same
work). Turns 1..--turns send --new new tokens each and generate --gen (greedy); a round is
one turn of every session of one side, --clients threads taking sessions from a shared
queue; the two sides' rounds alternate (A B, then B A, ...). TTFT: from sending the
request to the first response carrying tokens, at the client, through the router.
Every turn's cache_n is checked against the session's acknowledged history. A turn whose
stream is cut is sent again with its turn_id, as the client library does (`resent`;
`resent_replaced`: the dead replica had kept it, and the resend replaced that copy).

Then the kill: one more round on the `session` side with a replica SIGKILLed once a third
of the round's turns are answered; the turns are counted (served and continuing exactly,
failed with a status, lost = continuing a shorter history); then a round after it, where
the killed replica's sessions are restored by the others from the store. The last line
printed is one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_class, cpu_model, cpu_seconds  # noqa: E402
from service import Service  # noqa: E402

from inference_svc.client import (  # noqa: E402
    InferenceClient,
    keeps_turn_ids,
    make_request,
    resendable,
    stream_cut,
)
from inference_svc.pb import inference_pb2 as pb  # noqa: E402
from snapshot_svc.client import SnapshotClient  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402


def router_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_router", ROOT / "deploy" / "router.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deploy_router"] = mod
    spec.loader.exec_module(mod)
    return mod


router = router_module()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Haproxy:
    """HAProxy on the host with deploy/router.py's configuration for `balance`."""

    def __init__(self, balance: str, replicas: list[tuple[int, int]], scratch: Path,
                 env: dict[str, str] | None = None) -> None:
        """replicas: (gRPC port, HTTP port or 0); env: more WARMSLOT_ROUTER_* settings."""
        self.port, self.stats = free_port(), free_port()
        s = router.read_settings({
            "WARMSLOT_ROUTER_REPLICAS": ",".join(f"127.0.0.1:{g}:{h}" for g, h in replicas),
            "WARMSLOT_ROUTER_BIND": "127.0.0.1", "WARMSLOT_ROUTER_GRPC_PORT": str(self.port),
            "WARMSLOT_ROUTER_HTTP_PORT": "0", "WARMSLOT_ROUTER_STATS_PORT": str(self.stats),
            "WARMSLOT_ROUTER_BALANCE": balance, **(env or {})})
        cfg = scratch / f"haproxy-{balance}-{self.port}.cfg"
        cfg.write_text(router.config(s))
        self.log = open(scratch / f"haproxy-{balance}-{self.port}.log", "w")  # noqa: SIM115
        self.p = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=self.log,
                                  stderr=subprocess.STDOUT)
        self.backend = "grpc_rr" if balance == "roundrobin" else "grpc_session"
        try:
            self.wait_up(len(replicas), 60)
        except BaseException:
            self.stop()  # never leave a router behind
            raise

    def states(self) -> dict[str, str]:
        return router.servers_up(f"127.0.0.1:{self.stats}")[self.backend]

    def wait_up(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if sum(v.startswith("UP") for v in self.states().values()) == n:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"haproxy: {n} replicas not UP within {timeout} s")

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait(10)
        self.log.close()


class Replica:
    def __init__(self, args: argparse.Namespace, snap_addr: str, name: str,
                 scratch: Path) -> None:
        ns = argparse.Namespace(ctx=args.ctx, threads=1, n_max=4)
        self.name = name
        self.svc = Service(ns, args.target, args.draft, extra=(
            "--slots", str(args.slots), "--snapshot-addr", snap_addr, "--instance-id", name,
            "--session-write-through", "--session-ack-stored",
            "--session-ram-mb", str(args.ram_mb),
            "--fallback-save-path", str(scratch / f"fallback-{name}")))
        self.c = InferenceClient(f"127.0.0.1:{self.svc.port}", timeout=120)
        self.c.wait_ready(120)

    def local_sessions(self) -> set[str]:
        local = (pb.SESSION_TIER_SLOT, pb.SESSION_TIER_RAM)
        return {s.name for s in self.c.sessions() if s.tier in local}


def one_turn(c: InferenceClient, name: str, prompt: list[int], gen: int) -> dict[str, Any]:
    """One turn, streamed; a stream cut under it (its replica killed) is sent again with
    the turn's id, as the client library does (the TTFT is then the answered attempt's)."""
    t0 = time.perf_counter()
    request = make_request(prompt, max_tokens=gen, temperature=0.0, session=name,
                           turn_id=uuid.uuid4().hex)
    for resent in range(3):
        t_try = time.perf_counter()
        ttft = None
        n_out = 0
        last = None
        stream = c.generate_stream(request, timeout=300)
        try:
            for r in stream:
                if r.tokens and ttft is None:
                    ttft = time.perf_counter() - t_try
                n_out += len(r.tokens)
                last = r
        except grpc.RpcError as err:
            if resent == 2 or not stream_cut(err) or not resendable(request,
                                                                    keeps_turn_ids(stream)):
                raise
            continue
        break
    assert last is not None
    t = last.timings
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t_try,
            "total": time.perf_counter() - t0, "cache_n": t.cache_n, "n_out": n_out,
            "resent": resent, "discarded": t.session_n_discarded,
            # the server's parts of the turn: waiting to start (the session check and the
            # displaced session's capture included), the session's restore, the prompt
            "queue_ms": t.queue_ms, "restore_ms": t.session_restore_ms, "prompt_ms": t.prompt_ms,
            "tier": pb.SessionTier.Name(t.session_tier).removeprefix("SESSION_TIER_").lower()}


class Side:
    """One routing policy's router and sessions."""

    def __init__(self, name: str, proxy: Haproxy, n: int, corpus: list[int], tokens: int,
                 new: int) -> None:
        self.name = name
        self.proxy = proxy
        self.sessions = [f"{name}-{i}" for i in range(n)]
        self.history = dict.fromkeys(self.sessions, 0)
        self.corpus = corpus
        self.tokens = tokens
        self.new = new
        self.turns_sent = dict.fromkeys(self.sessions, 0)

    def prompt(self, i: int, turn: int) -> list[int]:
        """The same tokens on both sides: session i's turn `turn`."""
        n = self.tokens if turn == 0 else self.new
        start = (i * 997 + turn * self.new) % (len(self.corpus) - n)
        return self.corpus[start:start + n]


def run_round(side: Side, turn: int, clients: int, gen: int, seed: int,
              on_answer: Any = None) -> list[dict[str, Any]]:
    """One turn of every session of `side`, `clients` threads; the records."""
    order = list(enumerate(side.sessions))
    random.Random(seed).shuffle(order)
    work: queue.Queue[tuple[int, str]] = queue.Queue()
    for item in order:
        work.put(item)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client() -> None:
        with InferenceClient(f"127.0.0.1:{side.proxy.port}", timeout=300) as c:
            while True:
                try:
                    i, name = work.get_nowait()
                except queue.Empty:
                    return
                prompt = side.prompt(i, turn)
                acked = side.history[name]
                try:
                    rec = one_turn(c, name, prompt, gen)
                except grpc.RpcError as exc:
                    rec = {"error": exc.code().name, "details": (exc.details() or "")[:200]}
                rec.update(session=name, turn=turn, acked=acked)
                if "error" not in rec:
                    rec["outcome"] = ("continued" if rec["cache_n"] == acked else
                                      "lost" if rec["cache_n"] < acked else "wrong")
                    side.history[name] = rec["cache_n"] + len(prompt) + rec["n_out"]
                with lock:
                    records.append(rec)
                    if on_answer is not None:
                        on_answer(len(records))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def cpu_used(pids: list[int]) -> float:
    """CPU seconds the processes have used so far."""
    return sum(cpu_seconds(p) for p in pids)


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if "error" not in r]
    out: dict[str, Any] = {"turns": len(records), "served": len(ok),
                           "outcomes": dict(collections.Counter(r["outcome"] for r in ok)),
                           "errors": dict(collections.Counter(
                               r["error"] for r in records if "error" in r)),
                           "tiers": dict(collections.Counter(r["tier"] for r in ok)),
                           # served after their stream was cut and the turn sent again;
                           # of those, the ones that replaced a copy the dead replica kept
                           "resent": sum(1 for r in ok if r["resent"]),
                           "resent_replaced": sum(1 for r in ok
                                                  if r["resent"] and r["discarded"])}
    if ok:
        ttft = sorted(r["ttft"] for r in ok)
        out.update(ttft_median_ms=round(statistics.median(ttft) * 1e3, 1),
                   ttft_p90_ms=round(ttft[int(0.9 * (len(ttft) - 1))] * 1e3, 1),
                   total_median_ms=round(statistics.median(r["total"] for r in ok) * 1e3, 1),
                   # where each turn found its session: what routing changes
                   ttft_median_ms_by_tier={
                       tier: round(statistics.median(r["ttft"] for r in ok
                                                     if r["tier"] == tier) * 1e3, 1)
                       for tier in sorted({r["tier"] for r in ok})},
                   # the server's timings by tier (medians, ms): where a turn's TTFT goes
                   server_ms_by_tier={
                       tier: {k: round(statistics.median(r[f"{k}_ms"] for r in ok
                                                         if r["tier"] == tier), 1)
                              for k in ("queue", "restore", "prompt")}
                       for tier in sorted({r["tier"] for r in ok})})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=1500, help="first turn's prompt tokens")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="later turns per session and side")
    ap.add_argument("--new", type=int, default=40, help="new prompt tokens of a later turn")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ram-mb", type=int, default=1536,
                    help="each replica's --session-ram-mb: room for both sides' sessions, so "
                         "that one side's round does not push the other's out of RAM")
    ap.add_argument("--toy", action="store_true", help="the bundled toy models")
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if shutil.which("haproxy") is None:
        raise SystemExit("bench/router.py needs haproxy on the host (apt-get install haproxy)")
    models = ROOT / "models"
    args.target, args.draft = ((models / "target.gguf", models / "draft.gguf") if args.toy
                               else (models / "SmolLM2-135M-Instruct.Q4_1.gguf",
                                     models / "smollm2-draft.gguf"))
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(), "cpu_class": cpu_class(), "cores": os.cpu_count(),
        "models": [args.target.name, args.draft.name],
        "config": {k: v for k, v in vars(args).items()
                   if k not in ("target", "draft", "out")},
        "haproxy": subprocess.run(["haproxy", "-v"], capture_output=True,
                                  text=True).stdout.splitlines()[0]}
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        scratch = Path(tmp)
        snap = ServerProcess(scratch / "snap")
        reps: list[Replica] = []
        proxies: list[Haproxy] = []
        try:
            for i in range(args.replicas):
                reps.append(Replica(args, snap.address, f"r{i}", scratch))
            ports = [(r.svc.port, 0) for r in reps]
            affine = Haproxy("session", ports, scratch)
            rr = Haproxy("roundrobin", ports, scratch)
            proxies = [affine, rr]
            pids = ([r.svc.p.pid for r in reps] + [snap.proc.pid, affine.p.pid, rr.p.pid,
                                                   os.getpid()])
            text = "\n".join(p.read_text() for d in ("inference_svc", "snapshot_svc", "docs")
                             for p in sorted((ROOT / d).glob("*.*"))
                             if p.suffix in (".py", ".md"))
            corpus = reps[0].c.tokenize(text[:400_000])
            sides = {"session": Side("session", affine, args.sessions, corpus, args.tokens,
                                     args.new),
                     "roundrobin": Side("roundrobin", rr, args.sessions, corpus, args.tokens,
                                        args.new)}
            rounds: dict[str, list[dict[str, Any]]] = {"session": [], "roundrobin": []}
            per_turn: dict[str, list[dict[str, Any]]] = {"session": [], "roundrobin": []}
            for turn in range(args.turns + 1):
                order = ["session", "roundrobin"] if turn % 2 == 0 else ["roundrobin",
                                                                          "session"]
                for name in order:
                    t0 = time.perf_counter()
                    cpu0 = cpu_used(pids)
                    recs = run_round(sides[name], turn, args.clients, args.gen,
                                     args.seed + turn)
                    s = summary(recs)
                    # CPU seconds of every process of the run (replicas, snapshot
                    # service, routers, this client) per turn of the round
                    s.update(turn=turn, seconds=round(time.perf_counter() - t0, 1),
                             cpu_s_per_turn=round((cpu_used(pids) - cpu0) / len(recs), 3))
                    per_turn[name].append(s)
                    print(json.dumps({"side": name, **s}), file=sys.stderr, flush=True)
                    if turn > 0:
                        rounds[name] += recs
                if turn == 0:
                    with SnapshotClient(snap.address, timeout=30) as sc:
                        info = sc.stat("session~~session-0")
                    out["session_state_after_turn_0"] = {
                        "tokens": info.target.meta.n_tokens, "bytes": info.total_bytes}
                    out["sessions_per_replica_session_side"] = {
                        r.name: len({n for n in r.local_sessions() if n.startswith("session-")})
                        for r in reps}
            later = {k: summary(v) for k, v in rounds.items()}
            # the per-round ratio (rr / session median TTFT), paired by turn
            ratios = [b["ttft_median_ms"] / a["ttft_median_ms"]
                      for a, b in zip(per_turn["session"][1:], per_turn["roundrobin"][1:],
                                      strict=True)]
            out.update(rounds=per_turn, later_turns=later,
                       ttft_ratio_roundrobin_over_session={
                           "of_medians": round(later["roundrobin"]["ttft_median_ms"]
                                               / later["session"]["ttft_median_ms"], 2),
                           "median_of_rounds": round(statistics.median(ratios), 2),
                           "per_round": [round(x, 2) for x in ratios]})
            # the kill: a third of a round answered, then the replica holding the most
            # of the session side's sessions is SIGKILLed
            side = sides["session"]
            victim = max(reps, key=lambda r: len(r.local_sessions()))
            victim_sessions = {n for n in victim.local_sessions() if n.startswith("session-")}
            killed = threading.Event()
            kill_at = args.sessions // 3

            def on_answer(n: int) -> None:
                if n >= kill_at and not killed.is_set():
                    killed.set()
                    victim.svc.p.send_signal(signal.SIGKILL)

            turn = args.turns + 1
            t0 = time.perf_counter()
            kill_recs = run_round(side, turn, args.clients, args.gen, args.seed + turn,
                                  on_answer)
            kill_s = round(time.perf_counter() - t0, 1)
            after_recs = run_round(side, turn + 1, args.clients, args.gen, args.seed + turn + 1)
            moved = [r for r in after_recs if r["session"] in victim_sessions and "error" not in r]
            out["kill"] = {
                "victim": victim.name, "victim_sessions": len(victim_sessions),
                "killed_after_answers": kill_at, "round": summary(kill_recs),
                "round_seconds": kill_s,
                "errors_detail": sorted({f"{r['error']}: {r['details']}"
                                         for r in kill_recs if "error" in r})[:5],
                "round_after": summary(after_recs),
                "moved_sessions_after": summary(moved),
                "router_states_after": affine.states()}
            victim.svc.p.wait(10)
            reps.remove(victim)
        finally:
            for p in proxies:
                p.stop()
            for r in reps:
                r.c.close()
                r.svc.p.terminate()
            for r in reps:
                r.svc.p.wait(120)
            snap.terminate()
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    out["load_avg_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    line = json.dumps(out)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
