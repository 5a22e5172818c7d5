"""Security load probe: no client starves the others, large prompts stay bounded, and
what TLS costs.

    .venv/bin/python bench/security.py [--idle-timeout 5] [--reps 5]   (make bench-security)

1. Starvation (snapshot service, its own process, keys A and B in two namespaces):
   40 Put streams of key A send a header declaring 4 MiB and then nothing. Meanwhile
   key B makes 100 Hello and 100 List calls (latency p99) and one 16 MiB Put. Then the
   probe waits for the 40 streams to end: each is refused at once (per-key stream
   limit, RESOURCE_EXHAUSTED) or cancelled at the idle timeout (DEADLINE_EXCEEDED), and
   the data directory's disk usage is back to where it was (reservations freed).
2. Prompts (inference service with the bundled models, its own process): 4 concurrent
   Tokenize calls of a ~4 MiB text (just under gRPC's 4 MiB message limit), with the
   default --max-prompt-bytes (refused before tokenizing) and with the limit raised to
   8 MiB (tokenized on the bounded pool, in pieces); then, limit raised, 4 concurrent
   Generate calls of that text with truncate_prompt (every token of the text counted,
   the last ones kept) and max_tokens 1. The server's RSS is sampled every 10 ms: peak
   growth over the baseline, and growth 5 s after the calls end; GetInfo p99 meanwhile
   (at least 200 calls, so that p99 is not the single slowest).
3. TLS cost, plaintext and TLS servers side by side, interleaved, medians over --reps:
   Generate tokens/s (greedy, 64 tokens, the same prompt) and a 64 MiB snapshot Put.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from inference_svc.client import InferenceClient  # noqa: E402
from snapshot_svc.client import SnapshotClient  # noqa: E402
from snapshot_svc.clientlib.tls import channel_credentials  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402
from tests.seckit import make_ca, make_cert, write_keys  # noqa: E402
from tests.test_security_limits import _disk_bytes, _IdlePut  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
A, B = "probe-key-tenant-a-0123456789", "probe-key-tenant-b-0123456789"


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def starvation(work: Path, idle_timeout: float) -> dict[str, object]:
    keys = write_keys(work / "snap-keys", {A: "namespace=a", B: "namespace=b"})
    data = work / "starve-data"
    with ServerProcess(data, "--api-keys", str(keys), "--stream-idle-timeout",
                       str(idle_timeout), "--spare-bytes", "0") as srv:
        addr = f"127.0.0.1:{srv.port}"

        class Srv:  # what _IdlePut needs of a server
            address = addr

        base = _disk_bytes(data)
        t0 = time.monotonic()
        idle = [_IdlePut(Srv, A, f"idle{i}", 4 * MIB) for i in range(40)]  # type: ignore[arg-type]
        hello, lst = [], []
        with SnapshotClient(addr, api_key=B) as b:
            for _ in range(100):
                t = time.perf_counter()
                b.server_info()
                hello.append(time.perf_counter() - t)
                b._info = None  # Hello again next time
                t = time.perf_counter()
                b.list()
                lst.append(time.perf_counter() - t)
            data16 = os.urandom(16 * MIB)
            t = time.perf_counter()
            b.put("big", data16)
            put_s = time.perf_counter() - t
            put_ok = bytes(b.get("big").target) == data16
            b.delete("big")
        codes = [p.error().code().name for p in idle]
        ended_s = time.monotonic() - t0
        after = _disk_bytes(data)
    return {"hello_p99_ms": round(p99(hello) * 1e3, 2), "list_p99_ms": round(p99(lst) * 1e3, 2),
            "put_16mib_ok": put_ok, "put_16mib_s": round(put_s, 3),
            "idle_outcomes": {c: codes.count(c) for c in sorted(set(codes))},
            "idle_all_ended_s": round(ended_s, 2), "idle_timeout_s": idle_timeout,
            "disk_bytes_before": base, "disk_bytes_after": after}


@contextmanager
def inference(*args: str) -> Iterator[tuple[int, int]]:
    """python -m inference_svc with the bundled models: (pid, port)."""
    proc = subprocess.Popen([sys.executable, "-m", "inference_svc", "--port", "0",
                             "--slots", "2", "--no-auto-save", *args], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    port = 0
    for line in proc.stderr:
        rec = json.loads(line)
        if rec.get("msg") == "listening":
            port = rec["port"]
        if rec.get("msg") in ("serving", "cannot start"):
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    try:
        yield proc.pid, port
    finally:
        proc.terminate()
        proc.wait(60)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def prompts(extra: list[str], rpc: str = "tokenize") -> dict[str, object]:
    text = "The quick brown fox jumps over the lazy dog. " * ((4 * MIB - 64 * 1024) // 45)
    with inference(*extra) as (pid, port):
        addr = f"127.0.0.1:{port}"
        with InferenceClient(addr, timeout=300) as c:
            c.tokenize("warm up")
            c.info()
            time.sleep(1.0)
            base = rss(pid)
            peak = [base]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss(pid))
                    done.wait(0.01)

            codes: list[str] = []

            def big() -> None:
                with InferenceClient(addr, timeout=300) as cc:
                    try:
                        if rpc == "tokenize":
                            cc.tokenize(text)
                        else:
                            cc.generate(text, max_tokens=1, temperature=0.0,
                                        truncate_prompt=True, cache_prompt=False)
                        codes.append("OK")
                    except grpc.RpcError as exc:
                        codes.append(exc.code().name)

            sampler = threading.Thread(target=sample)
            sampler.start()
            workers = [threading.Thread(target=big) for _ in range(4)]
            for w in workers:
                w.start()
            lat = []
            while any(w.is_alive() for w in workers) or len(lat) < 200:
                t = time.perf_counter()
                c.info()
                lat.append(time.perf_counter() - t)
            for w in workers:
                w.join()
            done.set()
            sampler.join()
            time.sleep(5.0)
            later = rss(pid)
    return {"rpc": rpc, "args": extra, "codes": sorted(codes), "rss_base_mb": round(base / MIB, 1),
            "rss_peak_growth_mb": round((peak[0] - base) / MIB, 1),
            "rss_growth_5s_after_mb": round((later - base) / MIB, 1),
            "getinfo_p99_ms": round(p99(lat) * 1e3, 2), "getinfo_calls": len(lat)}


def tls_cost(work: Path, reps: int) -> dict[str, object]:
    ca = make_ca(work, "ca")
    cert = make_cert(work, "server", ca)
    creds = channel_credentials(ca[0])
    tls_args = ["--tls-cert", str(cert[0]), "--tls-key", str(cert[1])]
    blob = os.urandom(64 * MIB)
    req = {"max_tokens": 64, "temperature": 0.0}
    gen: dict[str, list[float]] = {"plain": [], "tls": []}
    put: dict[str, list[float]] = {"plain": [], "tls": []}
    with inference() as (_, p_port), inference(*tls_args) as (_, t_port), \
            ServerProcess(work / "plain-data") as sp, \
            ServerProcess(work / "tls-data", *tls_args) as st, \
            InferenceClient(f"127.0.0.1:{p_port}", timeout=300) as ip, \
            InferenceClient(f"localhost:{t_port}", timeout=300, credentials=creds) as it, \
            SnapshotClient(f"127.0.0.1:{sp.port}") as cp, \
            SnapshotClient(f"localhost:{st.port}", credentials=creds) as ct:
        sides: dict[str, tuple[InferenceClient, SnapshotClient]] = {
            "plain": (ip, cp), "tls": (it, ct)}
        for c, s in sides.values():  # warm-up
            c.generate("Once upon a time", **req)
            s.put("warm", blob)
        for r in range(reps):
            for side in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                c, s = sides[side]
                t = time.perf_counter()
                responses, _ = c.generate("Once upon a time", **req)
                n = sum(len(r.tokens) for r in responses)
                gen[side].append(n / (time.perf_counter() - t))
                t = time.perf_counter()
                s.put("blob", blob)
                put[side].append(64 / (time.perf_counter() - t))
    med = {k: {s: statistics.median(v) for s, v in d.items()}
           for k, d in (("generate_tokens_per_s", gen), ("put_64mib_mib_per_s", put))}
    return {**{k: {s: round(x, 1) for s, x in v.items()} for k, v in med.items()},
            "generate_tls_vs_plain": round(med["generate_tokens_per_s"]["tls"]
                                           / med["generate_tokens_per_s"]["plain"], 3),
            "put_tls_vs_plain": round(med["put_64mib_mib_per_s"]["tls"]
                                      / med["put_64mib_mib_per_s"]["plain"], 3),
            "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-timeout", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="starvation,prompts,tls")
    args = ap.parse_args()
    parts = args.parts.split(",")
    out: dict[str, object] = {"bench": "security"}
    with tempfile.TemporaryDirectory(prefix="warmslot-security-") as tmp:
        work = Path(tmp)
        steps: dict[str, Callable[[], object]] = {
            "starvation": lambda: starvation(work, args.idle_timeout),
            "prompts": lambda: [prompts([]), prompts(["--max-prompt-bytes", str(8 * MIB)]),
                                prompts(["--max-prompt-bytes", str(8 * MIB)], "generate")],
            "tls": lambda: tls_cost(work, args.reps)}
        for name in parts:
            out[name] = steps[name]()
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
