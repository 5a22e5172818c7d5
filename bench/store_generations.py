"""What generations and conditional Puts cost the snapshot service, on its local
directory and on S3 (a SeaweedFS started on 127.0.0.1), measured A/B interleaved.

    .venv/bin/python bench/store_generations.py [--reps 40] [--sizes-kib 64,4096]
        [--commits 200] [--out docs/results/store-generations-DATE.json]

1. Through a snapshot-service process on each backend: an unconditional Put
   (`put(name, data)`) against a conditional one (`put(name, data,
   expected_generation=g)`, g the generation the previous Put returned), of the same
   bytes to two names of their own, alternating which goes first; per-Put wall time,
   medians and the ratio conditional / unconditional. What the condition adds: one
   Stat of the name before the data is received (the early check) and the check at
   the commit.
2. The S3 commit point alone, straight to SeaweedFS with boto3: the manifest written
   as before generations (one PutObject) against as now (GetObject of the current
   manifest for its generation and ETag, then PutObject with If-Match), interleaved;
   per-commit medians and ratio.
3. Races on SeaweedFS: rounds of 2 (`--races` rounds) and of 8 (`--races8` rounds)
   threads writing one object with the same If-Match ETag (and as many with
   If-None-Match: * on a fresh key) at once; how many writes each round accepted
   (exactly 1 every round is what the backend relies on) and each write's latency.

The last line printed is one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import boto3  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402
from machine import commit_of_repo, cpu_model, emit  # noqa: E402

from snapshot_svc.client import SnapshotClient  # noqa: E402
from snapshot_svc.s3client import make_client  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.seaweed import SeaweedFS  # noqa: E402
from tests.snapkit import blob  # noqa: E402

BUCKET = "warmslot-bench"


def med_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def puts(client: SnapshotClient, data: bytes, reps: int, tag: str) -> dict[str, Any]:
    """Unconditional and conditional Puts of `data`, interleaved (warmed up first)."""
    plain, cond = f"{tag}-plain", f"{tag}-cond"
    client.put(plain, data)
    gen = client.put(cond, data, expected_generation=0).generation
    for _ in range(3):  # warm-up, not counted
        client.put(plain, data)
        gen = client.put(cond, data, expected_generation=gen).generation
    t_plain: list[float] = []
    t_cond: list[float] = []
    for i in range(reps):
        order = ("plain", "cond") if i % 2 == 0 else ("cond", "plain")
        for which in order:
            t0 = time.perf_counter()
            if which == "plain":
                client.put(plain, data)
                t_plain.append(time.perf_counter() - t0)
            else:
                gen = client.put(cond, data, expected_generation=gen).generation
                t_cond.append(time.perf_counter() - t0)
    assert gen == reps + 4, gen
    return {"unconditional_ms": med_ms(t_plain), "conditional_ms": med_ms(t_cond),
            "ratio": round(statistics.median(t_cond) / statistics.median(t_plain), 3),
            "reps": reps}


def manifest_commits(fs: SeaweedFS, n: int) -> dict[str, Any]:
    """The S3 commit point alone: one PutObject, or GetObject + PutObject(If-Match)."""
    os.environ.update(fs.env())
    s3 = make_client(fs.endpoint, "", 4)
    body = json.dumps({"snapshot": {"name": "x" * 40, "commit_id": "0" * 32,
                                    "target": {"sha256": "a" * 64, "size": 1 << 24},
                                    "draft": {"sha256": "b" * 64, "size": 1 << 20},
                                    "generation": 1}, "target_key": "k" * 80,
                       "draft_key": "d" * 80}).encode()
    s3.put_object(Bucket=BUCKET, Key="m/old", Body=body)
    s3.put_object(Bucket=BUCKET, Key="m/new", Body=body)
    old: list[float] = []
    new: list[float] = []
    for i in range(n + 10):
        for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
            t0 = time.perf_counter()
            if which == "old":
                s3.put_object(Bucket=BUCKET, Key="m/old", Body=body + b" " * (i % 7),
                              ContentType="application/json")
            else:
                r = s3.get_object(Bucket=BUCKET, Key="m/new")
                json.loads(r["Body"].read())
                s3.put_object(Bucket=BUCKET, Key="m/new", Body=body + b" " * (i % 7),
                              ContentType="application/json", IfMatch=r["ETag"])
            dt = time.perf_counter() - t0
            if i >= 10:  # the first ten of each are the warm-up
                (old if which == "old" else new).append(dt)
    s3.close()
    return {"put_only_ms": med_ms(old), "get_then_conditional_put_ms": med_ms(new),
            "ratio": round(statistics.median(new) / statistics.median(old), 3), "n": n}


def races(fs: SeaweedFS, rounds: int, writers: int) -> dict[str, Any]:
    """Winners per round of `writers` simultaneous conditional writes of one object
    (each write on a thread of its own; a write that gets no answer within 10 s, or
    another error, is counted, not retried)."""
    env = fs.env()
    s3 = boto3.client("s3", endpoint_url=fs.endpoint, region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                      config=Config(s3={"addressing_style": "path"}, read_timeout=10,
                                    connect_timeout=5, retries={"max_attempts": 1},
                                    max_pool_connections=2 * writers))
    out: dict[str, Any] = {}
    for mode in ("if_match", "if_none_match"):
        winners: list[int] = []
        failures: list[str] = []
        lat: list[float] = []
        for r in range(rounds):
            key = f"race/{writers}/{mode}/{r if mode == 'if_none_match' else 0}"
            cond: dict[str, str] = {"IfNoneMatch": "*"}
            if mode == "if_match":
                etag = s3.put_object(Bucket=BUCKET, Key=key, Body=b"%d" % r)["ETag"]
                cond = {"IfMatch": etag}
            barrier = threading.Barrier(writers)
            won: list[int] = []

            def write(w: int, key: str = key, cond: dict[str, str] = cond,
                      barrier: threading.Barrier = barrier, r: int = r,
                      won: list[int] = won, failures: list[str] = failures,
                      lat: list[float] = lat) -> None:
                barrier.wait(30)
                t0 = time.perf_counter()
                try:
                    s3.put_object(Bucket=BUCKET, Key=key, Body=b"%d-%d" % (r, w), **cond)
                    won.append(w)
                    lat.append(time.perf_counter() - t0)
                except ClientError as exc:
                    code = exc.response.get("Error", {}).get("Code", "")
                    lat.append(time.perf_counter() - t0)
                    if code not in ("PreconditionFailed", "ConditionalRequestConflict"):
                        failures.append(f"round {r}: {code}")
                except Exception as exc:  # noqa: BLE001 - counted
                    failures.append(f"round {r}: {type(exc).__name__}")

            threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            winners.append(len(won))
        out[mode] = {"rounds": rounds, "writers": writers,
                     "rounds_with_exactly_one_winner": winners.count(1),
                     "winners_min": min(winners), "winners_max": max(winners),
                     "write_ms_p50": round(statistics.median(lat) * 1e3, 1),
                     "write_ms_p90": round(sorted(lat)[int(0.9 * len(lat))] * 1e3, 1),
                     "write_ms_max": round(max(lat) * 1e3, 1),
                     "failed_writes": failures[:20], "failed_count": len(failures)}
    s3.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--sizes-kib", default="64,4096")
    ap.add_argument("--commits", type=int, default=200)
    ap.add_argument("--races", type=int, default=100)
    ap.add_argument("--races8", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes_kib.split(",")]
    work = Path(tempfile.mkdtemp(prefix="store-gen-"))
    result: dict[str, Any] = {
        "bench": "store_generations", "date": datetime.date.today().isoformat(),
        "commit": commit_of_repo(), "cpu": cpu_model(), "cpus": os.cpu_count(),
        "command": "bench/store_generations.py " + " ".join(sys.argv[1:]),
        "put": {}, "manifest_commit_s3": None}
    try:
        with SeaweedFS(work / "weed") as fs:
            env = fs.env()
            with ServerProcess(work / "local") as local, \
                    ServerProcess(None, "--store", f"s3://{BUCKET}/gen", "--s3-endpoint",
                                  fs.endpoint, "--replica-id", "bench", env=env) as s3srv:
                for backend, proc in (("local", local), ("s3", s3srv)):
                    with SnapshotClient(proc.address, timeout=60) as c:
                        assert c.conditional_writes
                        for kib in sizes:
                            r = puts(c, blob(kib, kib << 10), a.reps, f"{backend}-{kib}")
                            result["put"][f"{backend}_{kib}KiB"] = r
                            print(backend, f"{kib} KiB", r, flush=True)
            result["manifest_commit_s3"] = manifest_commits(fs, a.commits)
            print("manifest commit", result["manifest_commit_s3"], flush=True)
            result["races_s3"] = {"2_writers": races(fs, a.races, 2),
                                  "8_writers": races(fs, a.races8, 8)}
            print("races", result["races_s3"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
