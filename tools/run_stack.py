"""`make run`: the snapshot service and the inference service wired together on
127.0.0.1, in the foreground. Ctrl-C (or SIGTERM) stops the inference service
first, so it saves its slots into the snapshot service, then the snapshot
service. Their logs are interleaved on this terminal with a prefix each.

    python tools/run_stack.py [--port 50051] [--snapshot-port 50052] [--data DIR]
        [-- extra inference_svc flags]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import IO

ROOT = Path(__file__).resolve().parent.parent


def pump(prefix: str, stream: IO[str]) -> None:
    for line in stream:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def start(prefix: str, argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    threading.Thread(target=pump, args=(prefix, proc.stdout), daemon=True).start()
    return proc


def stop(proc: subprocess.Popen[str], timeout: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=50051, help="inference gRPC port")
    p.add_argument("--snapshot-port", type=int, default=50052, help="snapshot gRPC port")
    p.add_argument("--metrics-port", type=int, default=9090, help="inference metrics port")
    p.add_argument("--data", type=Path, default=ROOT / "var" / "snapshots",
                   help="the snapshot service's data directory")
    p.add_argument("extra", nargs="*", help="more inference_svc flags (after --)")
    args = p.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    snap = start("[snapshot] ", [py, "-m", "snapshot_svc", "--data-dir", str(args.data),
                                 "--host", "127.0.0.1", "--port", str(args.snapshot_port)])
    time.sleep(0.5)  # the inference service retries an unreachable store anyway
    inf = start("[inference]", [py, "-m", "inference_svc", "--host", "127.0.0.1",
                                "--port", str(args.port), "--metrics-port", str(args.metrics_port),
                                "--snapshot-addr", f"127.0.0.1:{args.snapshot_port}",
                                "--log-format", "text", *args.extra])
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"inference on 127.0.0.1:{args.port}, snapshots on 127.0.0.1:{args.snapshot_port} "
          f"({args.data}); Ctrl-C stops both", flush=True)
    while not done.wait(0.5):
        if inf.poll() is not None or snap.poll() is not None:
            break
    rc_inf = stop(inf, 120)  # saves every slot into the snapshot service
    rc_snap = stop(snap, 30)
    print(f"stopped: inference exit {rc_inf}, snapshot exit {rc_snap}", flush=True)
    return 0 if rc_inf == 0 and rc_snap == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
