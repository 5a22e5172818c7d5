"""How fast the router takes a stopping replica out: HAProxy checking grpc.health.v1 (a raw
HTTP/2 tcp-check) against checking the HTTP door's /health (bench/router_health.py).

    .venv/bin/python bench/router_health.py [--runs 3] [--out docs/results/router-health.json]

Two inference replicas (the bundled toy models, 1 thread, --http-port) and a snapshot
service on 127.0.0.1; two HAProxy processes configured by deploy/router.py over the same
replicas, one per check (`grpc`, `http`), both every 200 ms, out after 2 failures. Per run:
a long generation runs on replica r0 (so that its drain lasts --grace seconds), then r0 gets
SIGTERM; the stats pages of both routers are polled every 20 ms. Reported per check: the
time from the SIGTERM to DOWN, and whether r0's process had exited by then (a router that
marks a replica down only once it has exited sends it new requests while it drains, which
it refuses). r0 is started again between runs. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_class, cpu_model  # noqa: E402
from router import Haproxy  # noqa: E402
from service import Service  # noqa: E402

from inference_svc.client import InferenceClient, make_request  # noqa: E402
from snapshot_svc.testing import ServerProcess  # noqa: E402

MODELS = ROOT / "models"


def start(name: str, snap: str, grace: float, scratch: Path) -> Service:
    ns = argparse.Namespace(ctx=4096, threads=1, n_max=4)
    return Service(ns, MODELS / "target.gguf", MODELS / "draft.gguf", extra=(
        "--slots", "2", "--snapshot-addr", snap, "--instance-id", name, "--http-port", "0",
        "--shutdown-grace", str(grace), "--fallback-save-path", str(scratch / name)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--grace", type=float, default=5.0, help="r0's --shutdown-grace")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="router-health-") as tmp:
        scratch = Path(tmp)
        snap = ServerProcess(scratch / "snap")
        reps = [start(f"r{i}", snap.address, args.grace, scratch) for i in range(2)]
        ports = {f"r{i}": r.port for i, r in enumerate(reps)}
        # r0 is started again on its first ports (the routers' configuration names them)
        fixed = [(r.port, r.http_port) for r in reps]
        env = {"WARMSLOT_ROUTER_CHECK_INTER": "200"}
        proxies: dict[str, Haproxy] = {}
        r0_name = f"127.0.0.1-{ports['r0']}"
        try:
            for check in ("grpc", "http"):
                proxies[check] = Haproxy("session", fixed, scratch,
                                         {**env, "WARMSLOT_ROUTER_CHECK": check})
            for run in range(args.runs):
                r0 = reps[0]
                c = InferenceClient(f"127.0.0.1:{r0.port}", timeout=120)
                gen = threading.Thread(target=lambda c=c: _long(c), daemon=True)
                gen.start()
                time.sleep(0.5)  # the generation is running
                t0 = time.monotonic()
                r0.p.send_signal(signal.SIGTERM)
                down: dict[str, float | None] = dict.fromkeys(proxies)
                exited_at: float | None = None
                while time.monotonic() - t0 < args.grace + 60:
                    now = time.monotonic() - t0
                    if exited_at is None and r0.p.poll() is not None:
                        exited_at = now
                    for name, p in proxies.items():
                        if down[name] is None and p.states()[r0_name].startswith("DOWN"):
                            down[name] = now
                    if exited_at is not None and all(v is not None for v in down.values()):
                        break
                    time.sleep(0.02)
                c.close()
                gen.join(30)
                rec = {"run": run, "exited_s": _r(exited_at),
                       **{f"{k}_down_s": _r(v) for k, v in down.items()},
                       **{f"{k}_down_before_exit": v is not None and exited_at is not None
                          and v < exited_at for k, v in down.items()}}
                runs.append(rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)
                reps[0] = _restart(r0, snap.address, args.grace, scratch)
                for p in proxies.values():
                    p.wait_up(2, 120)
        finally:
            for p in proxies.values():
                p.stop()
            for r in reps:
                r.p.terminate()
            for r in reps:
                r.p.wait(120)
            snap.terminate()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
           "cpu_class": cpu_class(), "check_inter_ms": 200, "fall": 2, "grace_s": args.grace,
           "runs": runs,
           "median_down_s": {k: statistics.median(r[f"{k}_down_s"] for r in runs)
                             for k in ("grpc", "http")},
           "median_exited_s": statistics.median(r["exited_s"] for r in runs)}
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _long(c: InferenceClient) -> None:
    """A generation that outlasts the drain (cut at its end)."""
    try:
        for _ in c.generate_stream(make_request("def main():", max_tokens=3500,
                                                temperature=0.0), timeout=120):
            pass
    except Exception:  # noqa: BLE001 - cut by the stop: expected
        pass


def _restart(old: Service, snap: str, grace: float, scratch: Path) -> Service:
    """r0 again on the same gRPC and HTTP ports (the routers' configuration names them)."""
    ns = argparse.Namespace(ctx=4096, threads=1, n_max=4)
    return Service(ns, MODELS / "target.gguf", MODELS / "draft.gguf", extra=(
        "--slots", "2", "--snapshot-addr", snap, "--instance-id", "r0",
        "--fallback-save-path", str(scratch / "r0"), "--shutdown-grace", str(grace),
        "--http-port", str(old.http_port), "--port", str(old.port)))


if __name__ == "__main__":
    sys.exit(main())
