"""Restart-resume benchmark: time to first token of the next turn after a restart,
with restore against without restore (full re-prefill), in one run.

    .venv/bin/python bench/resume.py [--sizes 1024,2048,3072,max] [--reps 5]
                                     [--next-new 100] [--gen 16] [--threads 2]

Bundled models (models/target.gguf + models/draft.gguf), --ctx 4096, one slot,
speculative decoding at temperature 0, every service a real process on 127.0.0.1.

For each session size S (tokens in the slot; `max` = ctx - next turn - generated
tokens, the largest session the bundled model can continue) a session is built
once per store and saved by SIGTERM as `auto-bench-<S>-slot0`: in a local
directory (`--slot-save-path`) and in a snapshot service (`--snapshot-addr`,
a separate process). Then, in every repetition, three restarts run back to back
in a rotating order:

- cold:     a new process with no store; the next turn (the session plus
            --next-new tokens) re-prefills everything;
- local:    a new process that restores the slot from the local directory at
            start-up, then the same next turn;
- snapshot: the same from the snapshot service; right after it, the bench reads
            the same snapshot with SnapshotClient.get (a new client: connect,
            Hello, Get; then a second Get on that client), for the Get throughput.

A restored process erases its slot before its SIGTERM, so it saves nothing and
the snapshot stays the same for the next repetition.

Time to first token (TTFT) is measured by the client, from sending the request to
the first streamed token, once the process reports SERVING (the restore runs
before SERVING; its own time is reported apart, and `restart_to_first_token`
adds it: process start to first token). Restore throughput is bytes / ms of the
"slot restored" log line (target + .drft, fetched, checked and applied). Ratios
are medians of the per-repetition ratios. Every repetition also checks that the
restored turn processed the new tokens only (prompt_n and draft_prompt_n) and
produced exactly the cold turn's tokens; anything else is listed under
"anomalies". The last line printed is one JSON object.

Targets (issue 7): the restored turn's TTFT is at least 10x faster at ~4k tokens
(judged on the largest size: a 4096 context cannot hold a 4096-token session and
a next turn), and the restore runs at no less than half the snapshot service's
Get throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from snapshot_svc.client import SnapshotClient  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.resumekit import (  # noqa: E402
    DRAFT,
    TARGET,
    InferenceProcess,
    source_tokens,
)
from tests.resumekit import timed_turn as shared_timed_turn  # noqa: E402

TARGET_SPEEDUP = 10.0
TARGET_RESTORE_VS_GET = 0.5
N_MAX = 8
P_MIN = 0.75  # the service's default when speculative decoding is on
VARIANTS = ("cold", "local", "snapshot")


def timed_turn(proc: InferenceProcess, prompt: list[int], gen: int) -> dict[str, Any]:
    """One greedy speculative request on slot 0; TTFT measured by the client."""
    r = shared_timed_turn(proc, prompt, gen, N_MAX, P_MIN)
    t = r.timings
    return {"ttft_ms": r.ttft_ms, "total_ms": r.total_ms,
            "server_ttft_ms": t.queue_ms + t.prompt_ms, "prompt_ms": t.prompt_ms,
            "queue_ms": t.queue_ms, "prompt_n": t.prompt_n, "cache_n": t.cache_n,
            "draft_prompt_n": t.draft_prompt_n, "draft_n": t.draft_n,
            "draft_n_accepted": t.draft_n_accepted, "tokens": r.tokens}


class Bench:
    def __init__(self, a: argparse.Namespace, work: Path, snap: ServerProcess) -> None:
        self.a = a
        self.work = work
        self.snap = snap
        self.common = ("--model", str(TARGET), "--draft", str(DRAFT), "--slots", "1",
                       "--ctx", str(a.ctx), "--threads", str(a.threads),
                       "--shutdown-grace", "30")
        self.stores = {"local": ("--slot-save-path", str(work / "slots")),
                       "snapshot": ("--snapshot-addr", snap.address)}
        self.anomalies: list[str] = []

    def start(self, *args: str) -> tuple[InferenceProcess, float]:
        t0 = time.perf_counter()
        proc = InferenceProcess(*self.common, *args)
        return proc, 1e3 * (time.perf_counter() - t0)

    def build(self, store: str, size: int, prompt: list[int]) -> list[int]:
        """A session of `size` tokens on slot 0, saved by SIGTERM; returns its tokens."""
        gen = size - len(prompt)
        with self.start(*self.stores[store], "--instance-id", f"bench-{size}")[0] as p:
            res = timed_turn(p, prompt, gen)
            if p.stop() != 0:
                raise SystemExit(f"building the {size}-token session: bad exit")
            saved = p.records("slot saved")
        history = prompt + res["tokens"]
        if [(r["filename"], r["n_tokens"]) for r in saved] != [
                (f"auto-bench-{size}-slot0", len(history))]:
            raise SystemExit(f"the {size}-token session was not saved as expected: {saved}")
        return history

    def cold(self, history: list[int], new: list[int]) -> dict[str, Any]:
        proc, start_ms = self.start("--no-auto-save")  # no store: nothing to restore
        with proc:
            res = timed_turn(proc, history + new, self.a.gen)
            proc.stop()
        res["start_ms"] = start_ms
        res["restart_to_first_token_ms"] = start_ms + res["ttft_ms"]
        return res

    def restored(self, store: str, size: int, history: list[int],
                 new: list[int]) -> dict[str, Any]:
        proc, start_ms = self.start(*self.stores[store], "--instance-id", f"bench-{size}")
        with proc:
            recs = proc.records("slot restored")
            if len(recs) != 1:
                raise SystemExit(f"{store}: expected one restored slot, got {recs}: "
                                 f"{proc.lines[-5:]}")
            res = timed_turn(proc, history + new, self.a.gen)
            proc.client.erase(0)  # nothing to save: the snapshot stays for the next rep
            proc.stop()
            if proc.records("slot saved"):
                raise SystemExit(f"{store}: an erased slot was saved again")
        r = recs[0]
        res.update(start_ms=start_ms, restart_to_first_token_ms=start_ms + res["ttft_ms"],
                   restore_ms=r["ms"], restore_bytes=r["bytes"], restore_n_tokens=r["n_tokens"],
                   draft_policy=r["draft_policy"],
                   restore_MBps=r["bytes"] / r["ms"] / 1e3 if r["ms"] else None)
        return res

    def get_throughput(self, name: str) -> dict[str, Any]:
        """SnapshotClient.get of the stored snapshot: a new client, then again on it."""
        t0 = time.perf_counter()
        with SnapshotClient(self.snap.address, timeout=60) as c:
            got = c.get(name)
            t1 = time.perf_counter()
            again = c.get(name)
            t2 = time.perf_counter()
        n = len(got.target) + len(got.draft or b"")
        if again.target != got.target or again.draft != got.draft:
            raise SystemExit("two Gets of one snapshot returned different bytes")
        return {"get_bytes": n, "get_fresh_ms": 1e3 * (t1 - t0), "get_warm_ms": 1e3 * (t2 - t1),
                "get_fresh_MBps": n / (t1 - t0) / 1e6, "get_warm_MBps": n / (t2 - t1) / 1e6}

    def file_read(self, name: str) -> dict[str, Any]:
        """Reading the local store's two files (the page cache holds them: an upper bound)."""
        base = self.work / "slots" / name
        t0 = time.perf_counter()
        n = len(base.read_bytes()) + len(base.with_name(name + ".drft").read_bytes())
        dt = time.perf_counter() - t0
        return {"read_bytes": n, "read_ms": 1e3 * dt, "read_MBps": n / dt / 1e6}

    def check(self, size: int, rep: int, variant: str, res: dict[str, Any],
              cold: dict[str, Any], history: list[int], new: list[int]) -> None:
        where = f"size {size} rep {rep} {variant}"
        if res["restore_n_tokens"] != len(history):
            self.anomalies.append(f"{where}: restored {res['restore_n_tokens']} tokens, "
                                  f"the session has {len(history)}")
        if res["draft_policy"] != "sidecar":
            self.anomalies.append(f"{where}: draft policy {res['draft_policy']}, not sidecar")
        for key, want in (("prompt_n", len(new)), ("cache_n", len(history)),
                          ("draft_prompt_n", len(new))):
            if res[key] != want:
                self.anomalies.append(f"{where}: {key} = {res[key]} after the restore, "
                                      f"expected {want}")
        if variant == "snapshot" and res["get_bytes"] != res["restore_bytes"]:
            self.anomalies.append(f"{where}: Get read {res['get_bytes']} bytes, the restore "
                                  f"{res['restore_bytes']}")
        if res["tokens"] != cold["tokens"]:
            self.anomalies.append(f"{where}: output differs from the cold re-prefill "
                                  f"({res['tokens']} vs {cold['tokens']})")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(size: int, history: list[int], runs: list[dict[str, dict[str, Any]]]
              ) -> dict[str, Any]:
    cold = [r["cold"] for r in runs]
    out: dict[str, Any] = {
        "session_tokens": len(history), "reps": len(runs),
        "cold": {"ttft_ms": round(med([c["ttft_ms"] for c in cold]), 1),
                 "server_ttft_ms": round(med([c["server_ttft_ms"] for c in cold]), 1),
                 "prompt_n": cold[0]["prompt_n"],
                 "start_ms": round(med([c["start_ms"] for c in cold]), 1),
                 "restart_to_first_token_ms": round(
                     med([c["restart_to_first_token_ms"] for c in cold]), 1),
                 "ttft_all_ms": [round(c["ttft_ms"], 1) for c in cold]},
    }
    for store in ("local", "snapshot"):
        rs = [r[store] for r in runs]
        s: dict[str, Any] = {
            "ttft_ms": round(med([x["ttft_ms"] for x in rs]), 1),
            "server_ttft_ms": round(med([x["server_ttft_ms"] for x in rs]), 1),
            "prompt_n": [x["prompt_n"] for x in rs][0],
            "draft_prompt_n": [x["draft_prompt_n"] for x in rs][0],
            "acceptance": f"{rs[0]['draft_n_accepted']}/{rs[0]['draft_n']}",
            "identical_output": all(x["tokens"] == r["cold"]["tokens"]
                                    for x, r in zip(rs, runs, strict=True)),
            "speedup_ttft": round(med([r["cold"]["ttft_ms"] / r[store]["ttft_ms"]
                                       for r in runs]), 2),
            "speedup_server_ttft": round(med([r["cold"]["server_ttft_ms"]
                                              / r[store]["server_ttft_ms"] for r in runs]), 2),
            "speedup_ttft_incl_restore": round(med([
                r["cold"]["ttft_ms"] / (r[store]["ttft_ms"] + r[store]["restore_ms"])
                for r in runs]), 2),
            "restart_to_first_token_ms": round(
                med([x["restart_to_first_token_ms"] for x in rs]), 1),
            "start_ms": round(med([x["start_ms"] for x in rs]), 1),
            "restore_ms": round(med([x["restore_ms"] for x in rs]), 2),
            "restore_bytes": rs[0]["restore_bytes"],
            "restore_MBps": round(med([x["restore_MBps"] for x in rs]), 1),
            "ttft_all_ms": [round(x["ttft_ms"], 1) for x in rs],
            "restore_all_ms": [x["restore_ms"] for x in rs],
        }
        if store == "snapshot":
            s["get_bytes"] = rs[0]["get_bytes"]
            for k in ("get_fresh_ms", "get_warm_ms", "get_fresh_MBps", "get_warm_MBps"):
                s[k] = round(med([x[k] for x in rs]), 2)
            s["restore_vs_get_fresh"] = round(med([x["restore_MBps"] / x["get_fresh_MBps"]
                                                   for x in rs]), 3)
            s["restore_vs_get_warm"] = round(med([x["restore_MBps"] / x["get_warm_MBps"]
                                                  for x in rs]), 3)
        else:
            s["file_read_MBps"] = round(med([x["read_MBps"] for x in rs]), 1)
            s["restore_vs_file_read"] = round(med([x["restore_MBps"] / x["read_MBps"]
                                                   for x in rs]), 3)
        out[store] = s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,2048,3072,max",
                    help="session sizes in tokens, comma-separated; 'max': ctx - next turn")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--next-new", type=int, default=100, help="new tokens of the next turn")
    ap.add_argument("--gen", type=int, default=16, help="tokens generated by the next turn")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--work-dir", type=Path, default=ROOT / "bench" / "results",
                    help="where the run's scratch directory goes (local store and snapshot "
                         "data; removed at the end)")
    a = ap.parse_args()
    largest = a.ctx - a.next_new - a.gen
    sizes = sorted({largest if s.strip() == "max" else int(s) for s in a.sizes.split(",")})
    if sizes[-1] > largest or sizes[0] <= a.gen:
        raise SystemExit(f"sizes must be in ({a.gen}, {largest}]")
    for path in (TARGET, DRAFT):
        if not path.exists():
            raise SystemExit(f"missing {path}: the bundled models are needed")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="resume-", dir=a.work_dir))  # concurrent runs: apart
    load_before = os.getloadavg()
    results: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        with ServerProcess(work / "snapshots") as snap:
            b = Bench(a, work, snap)
            with b.start("--no-auto-save")[0] as p:
                text = source_tokens(p, largest + a.next_new)
                p.stop()
            for size in sizes:
                prompt = text[:size - a.gen]
                new = text[size - a.gen:size - a.gen + a.next_new]
                histories = {store: b.build(store, size, prompt) for store in b.stores}
                history = histories["local"]
                if histories["snapshot"] != history:
                    raise SystemExit(f"size {size}: the two builds generated different tokens")
                name = f"auto-bench-{size}-slot0"
                runs: list[dict[str, dict[str, Any]]] = []
                for rep in range(a.reps):
                    k = rep % len(VARIANTS)
                    order = VARIANTS[k:] + VARIANTS[:k]
                    run: dict[str, dict[str, Any]] = {}
                    for v in order:
                        if v == "cold":
                            run[v] = b.cold(history, new)
                        else:
                            run[v] = b.restored(v, size, history, new)
                            run[v].update(b.get_throughput(name) if v == "snapshot"
                                          else b.file_read(name))
                    for v in ("local", "snapshot"):
                        b.check(size, rep, v, run[v], run["cold"], history, new)
                    runs.append(run)
                    print(f"{len(history):5d} tokens rep {rep}: TTFT cold "
                          f"{run['cold']['ttft_ms']:7.1f} ms, restored local "
                          f"{run['local']['ttft_ms']:6.1f} ms (restore "
                          f"{run['local']['restore_ms']:.0f} ms), snapshot "
                          f"{run['snapshot']['ttft_ms']:6.1f} ms (restore "
                          f"{run['snapshot']['restore_ms']:.0f} ms, Get "
                          f"{run['snapshot']['get_warm_ms']:.0f} ms)", flush=True)
                results.append({"size": size, **summarize(size, history, runs)})
            snap.terminate()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    top = results[-1]
    meets_speedup = all(top[s]["speedup_ttft"] >= TARGET_SPEEDUP for s in ("local", "snapshot"))
    meets_restore = all(r["snapshot"]["restore_vs_get_fresh"] >= TARGET_RESTORE_VS_GET
                        for r in results)
    print(json.dumps({
        "bench": "resume", "models": [TARGET.name, DRAFT.name], "ctx": a.ctx,
        "next_turn": {"new_tokens": a.next_new, "generated": a.gen, "n_max": N_MAX,
                      "p_min": P_MIN},
        "threads": a.threads, "cpus": os.cpu_count(),
        "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "targets": {
            "speedup_ttft": f">= {TARGET_SPEEDUP}x at the largest size ({sizes[-1]} tokens)",
            "restore_vs_get": f">= {TARGET_RESTORE_VS_GET} of the snapshot service's Get "
                              f"throughput (new client), every size"},
        "meets_speedup": meets_speedup, "meets_restore_vs_get": meets_restore,
        "anomalies": b.anomalies, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
