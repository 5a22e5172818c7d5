"""Four inference-service processes on two S3-backed snapshot-service replicas: 200
distinct sessions saved and restored through the path the product takes.

    .venv/bin/python bench/s3_replicas.py [--sessions 200] [--replicas 4] [--slots 2]

Starts a SeaweedFS on 127.0.0.1, two snapshot-service processes on one bucket and
`--replicas` inference-service processes (the bundled toy pair) with
`--snapshot-addr a,b`. Every session i: a prompt of its own tokens is processed on
replica i % R (Generate, 4 greedy tokens), saved there (SaveSlot to the snapshot
service), the slot erased; then restored on ANOTHER replica ((i + 1) % R, RestoreSlot)
and continued with its whole history: the turn must find the history in the slot
(cache_n = history - 1 at least, prompt_n <= 1) and produce the same tokens as a
never-saved replica computes for that history. Every replica's slots work at once.
Counted: errors, lost (NOT_FOUND), mixed up (another session's state or other tokens).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from inference_svc.client import make_request  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.resumekit import DRAFT, TARGET, InferenceProcess  # noqa: E402
from tests.seaweed import SeaweedFS  # noqa: E402

NEW_TOKENS = 4


def history_of(i: int, n_vocab: int) -> list[int]:
    """A prompt of 48 tokens that no other session shares from its first token on."""
    return [(i * 7919 + k * 104729) % (n_vocab - 3) + 3 for k in range(48)]


def turn(proc: InferenceProcess, prompt: list[int], slot: int) -> tuple[list[int], Any]:
    req = make_request(prompt, max_tokens=NEW_TOKENS, id_slot=slot, temperature=0.0)
    out: list[int] = []
    last = None
    for resp in proc.client.generate_stream(req):
        out += list(resp.tokens)
        last = resp
    if last is None or not last.done:
        raise RuntimeError("the stream ended without its last response")
    return out, last.timings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ws-s3-replicas-"))
    fs = SeaweedFS(work / "seaweedfs")
    s3_args = ("--store", "s3://bench/replicas", "--s3-endpoint", fs.endpoint)
    counts = {"ok": 0, "errors": 0, "lost": 0, "mixed_up": 0}
    first_error: list[str] = []
    lock = threading.Lock()
    save_ms: list[float] = []
    restore_ms: list[float] = []
    try:
        with ServerProcess(None, *s3_args, "--replica-id", "r1", env=fs.env()) as s1, \
                ServerProcess(None, *s3_args, "--replica-id", "r2", env=fs.env()) as s2:
            addr = f"{s1.address},{s2.address}"
            procs = [InferenceProcess("--model", str(TARGET), "--draft", str(DRAFT),
                                      "--slots", str(a.slots), "--threads", "1",
                                      "--snapshot-addr", addr, "--instance-id", f"bench{r}",
                                      "--no-auto-save")
                     for r in range(a.replicas)]
            # never saves nor restores: what a never-saved slot computes
            reference = InferenceProcess("--model", str(TARGET), "--draft", str(DRAFT),
                                         "--slots", "1", "--threads", "1", "--no-auto-save")
            n_vocab = procs[0].client.info().model.n_vocab
            # one lane per (replica, slot): a lane runs its sessions one after another
            lanes = [(r, s) for r in range(a.replicas) for s in range(a.slots)]

            def one(i: int) -> None:
                r, s = lanes[i % len(lanes)]
                other = (r + 1) % a.replicas
                name = f"bench-session-{i:04d}"
                try:
                    hist = history_of(i, n_vocab)
                    with locks[(r, s)]:
                        out, _ = turn(procs[r], hist, s)
                        t0 = time.perf_counter()
                        procs[r].client.save(s, name)
                        t1 = time.perf_counter()
                        procs[r].client.erase(s)
                    hist += out
                    with locks[(other, s)]:
                        t2 = time.perf_counter()
                        procs[other].client.restore(s, name)
                        t3 = time.perf_counter()
                        got, timings = turn(procs[other], hist, s)
                    with ref_lock:
                        want, _ = turn(reference, hist, 0)
                    key = ("ok" if got == want and timings.prompt_n <= 1
                           and timings.cache_n >= len(hist) - 1 else "mixed_up")
                    with lock:
                        save_ms.append(1e3 * (t1 - t0))
                        restore_ms.append(1e3 * (t3 - t2))
                except grpc.RpcError as exc:
                    key = "lost" if exc.code() == grpc.StatusCode.NOT_FOUND else "errors"
                    with lock:
                        first_error.append(f"{exc.code().name}: {exc.details()}")
                with lock:
                    counts[key] += 1

            # a lane's slot is also where the previous replica's lane restores: each
            # use of a slot holds its lock (one at a time, never two held at once)
            locks = {lane: threading.Lock() for lane in lanes}
            ref_lock = threading.Lock()
            by_lane: dict[tuple[int, int], list[int]] = {lane: [] for lane in lanes}
            for i in range(a.sessions):
                by_lane[lanes[i % len(lanes)]].append(i)

            def run_lane(lane: tuple[int, int]) -> None:
                for i in by_lane[lane]:
                    one(i)

            t0 = time.perf_counter()
            with futures.ThreadPoolExecutor(len(lanes)) as pool:
                list(pool.map(run_lane, lanes))
            elapsed = time.perf_counter() - t0
            for p in [*procs, reference]:
                p.stop()
    finally:
        fs.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": "s3-replicas", "snapshot_replicas": 2, "inference_replicas": a.replicas,
              "slots": a.slots, "sessions": a.sessions, **counts,
              "first_error": first_error[:1], "seconds": round(elapsed, 2),
              "save_ms_median": round(statistics.median(save_ms), 1) if save_ms else None,
              "restore_ms_median": round(statistics.median(restore_ms), 1) if restore_ms else None,
              "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    return 0 if counts["ok"] == a.sessions else 1


if __name__ == "__main__":
    sys.exit(main())
